// A Node.js agent on the `openai` npm package that knows nothing of agl: no tracing, no agl code.
// `agl worker --command "node geo_agent.cjs"` runs it once per task: the task comes on stdin, the client
// reads OPENAI_BASE_URL (the rollout-scoped gateway) and OPENAI_API_KEY like any OpenAI client, and the
// last JSON line it prints is its reward.
const OpenAI = require("openai");

const tools = [{
  type: "function",
  function: {
    name: "lookup",
    description: "the country a city is in",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
}];
const COUNTRIES = { Paris: "France", Rome: "Italy" };

async function readStdin() {
  let data = "";
  for await (const chunk of process.stdin) data += chunk;
  return data;
}

async function main() {
  const task = JSON.parse(await readStdin());
  const client = new OpenAI({ maxRetries: 0 });
  const messages = [{ role: "user", content: `Which country is ${task.city} in?` }];
  const first = await client.chat.completions.create({ model: "policy", messages, tools });
  const reply = first.choices[0].message;
  messages.push({ role: "assistant", content: reply.content, tool_calls: reply.tool_calls });
  for (const call of reply.tool_calls ?? []) {
    const args = JSON.parse(call.function.arguments);
    messages.push({ role: "tool", tool_call_id: call.id, content: COUNTRIES[args.city] ?? "unknown" });
  }
  const stream = await client.chat.completions.create({ model: "policy", messages, stream: true });
  let answer = "";
  for await (const chunk of stream) answer += chunk.choices[0]?.delta?.content ?? "";
  console.log(`answer: ${answer}`);
  console.log(JSON.stringify({ reward: answer.includes(task.country) ? 1.0 : 0.0 }));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
