// A conversation through @openai/agents-realtime's RealtimeSession over its WebSocket transport,
// unchanged: the plan (JSON on stdin: url, apiKey, model, instructions, turns, maxOutputTokens)
// in, {texts, errors, types} out on stdout. Driven by tests/system/gateway/test_openai_sdks.py.
import { RealtimeAgent, RealtimeSession } from '@openai/agents-realtime';

const plan = JSON.parse(await new Promise((resolve) => {
  let data = '';
  process.stdin.on('data', (chunk) => { data += chunk; });
  process.stdin.on('end', () => resolve(data));
}));

const agent = new RealtimeAgent({ name: 'Assistant', instructions: plan.instructions });
const session = new RealtimeSession(agent, {
  transport: 'websocket',
  model: plan.model,
  config: { outputModalities: ['text'], providerData: { max_output_tokens: plan.maxOutputTokens } },
});
const errors = [];
const types = [];
const texts = [];
let onDone = null;
session.on('error', (error) => errors.push(String(error?.error?.message ?? error?.error ?? error)));
session.on('transport_event', (event) => {
  types.push(event.type);
  if (event.type === 'error') errors.push(JSON.stringify(event));
  if (event.type === 'response.output_text.done') texts.push(event.text);
  if (event.type === 'response.done' && onDone) onDone();
});
await session.connect({ apiKey: plan.apiKey, url: plan.url });
for (const turn of plan.turns) {
  const done = new Promise((resolve) => { onDone = resolve; });
  session.sendMessage(turn);
  await done;
}
session.close();
process.stdout.write(JSON.stringify({ texts, errors, types }));
