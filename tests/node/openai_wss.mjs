// A conversation through the npm `openai` SDK's Node realtime client (OpenAIRealtimeWS), which only
// dials wss://: the plan (JSON on stdin: baseURL, apiKey, model, instructions, turns,
// maxOutputTokens) in, {texts, errors, types} out. The gateway's self-signed certificate is
// trusted through NODE_EXTRA_CA_CERTS, as a user would. Driven by tests/system/gateway/test_openai_sdks.py.
import OpenAI from 'openai';
import { OpenAIRealtimeWS } from 'openai/realtime/ws';

const plan = JSON.parse(await new Promise((resolve) => {
  let data = '';
  process.stdin.on('data', (chunk) => { data += chunk; });
  process.stdin.on('end', () => resolve(data));
}));

const client = new OpenAI({ apiKey: plan.apiKey, baseURL: plan.baseURL });
const rt = new OpenAIRealtimeWS({ model: plan.model }, client);
const errors = [];
const types = [];
const texts = [];
const waiters = new Map();
const next = (type) => new Promise((resolve) => { waiters.set(type, resolve); });
rt.on('error', (error) => errors.push(String(error?.message ?? error)));
rt.on('event', (event) => {
  types.push(event.type);
  if (event.type === 'response.output_text.done') texts.push(event.text);
  const waiter = waiters.get(event.type);
  if (waiter) { waiters.delete(event.type); waiter(event); }
});
const created = next('session.created');
await new Promise((resolve, reject) => {
  rt.socket.on('open', resolve);
  rt.socket.on('error', reject);
});
await created;
const updated = next('session.updated');
rt.send({
  type: 'session.update',
  session: { type: 'realtime', instructions: plan.instructions, output_modalities: ['text'] },
});
await updated;
for (const turn of plan.turns) {
  rt.send({
    type: 'conversation.item.create',
    item: { type: 'message', role: 'user', content: [{ type: 'input_text', text: turn }] },
  });
  const done = next('response.done');
  rt.send({ type: 'response.create', response: { max_output_tokens: plan.maxOutputTokens } });
  await done;
}
rt.close();
process.stdout.write(JSON.stringify({ texts, errors, types }));
