// A function tool through @openai/agents-realtime's RealtimeSession over its WebSocket transport,
// unchanged: the user's turn goes in with its first response asking for tool_choice "required"
// (the transport's own sendMessage and requestResponse); the SDK runs the tool when the call
// arrives, sends its output and asks for the next response itself. Plan (JSON on stdin: url,
// apiKey, model, instructions, question, toolOutput, maxOutputTokens) in, {calls, texts, errors,
// types} out on stdout. Driven by tests/system/gateway/test_openai_tools.py.
import { RealtimeAgent, RealtimeSession, tool } from '@openai/agents-realtime';
import { z } from 'zod';

const plan = JSON.parse(await new Promise((resolve) => {
  let data = '';
  process.stdin.on('data', (chunk) => { data += chunk; });
  process.stdin.on('end', () => resolve(data));
}));

const calls = [];
const getWeather = tool({
  name: 'get_weather',
  description: 'The current weather in a city.',
  parameters: z.object({ city: z.string().max(16) }),
  execute: async ({ city }) => {
    calls.push(city);
    return plan.toolOutput;
  },
});
const agent = new RealtimeAgent({ name: 'Assistant', instructions: plan.instructions, tools: [getWeather] });
const session = new RealtimeSession(agent, {
  transport: 'websocket',
  model: plan.model,
  config: { outputModalities: ['text'], providerData: { max_output_tokens: plan.maxOutputTokens } },
});
const errors = [];
const types = [];
const texts = [];
let responses = 0;
let onSecond = null;
session.on('error', (error) => errors.push(String(error?.error?.message ?? error?.error ?? error)));
session.on('transport_event', (event) => {
  types.push(event.type);
  if (event.type === 'error') errors.push(JSON.stringify(event));
  if (event.type === 'response.output_text.done') texts.push(event.text);
  if (event.type === 'response.done') {
    responses += 1;
    if (responses === 2 && onSecond) onSecond();
  }
});
await session.connect({ apiKey: plan.apiKey, url: plan.url });
const second = new Promise((resolve) => { onSecond = resolve; });
session.transport.sendMessage(plan.question, {}, { triggerResponse: false });
session.transport.requestResponse({ tool_choice: 'required' });
await second;
session.close();
process.stdout.write(JSON.stringify({ calls, texts, errors, types }));
