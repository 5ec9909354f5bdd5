// A Node agent with its own tool loop on the openai package, traced by OpenInference's instrumentation and
// exported by the OpenTelemetry JS SDK's own OTLP/HTTP exporter. It knows nothing of agl: the standard
// OTEL_EXPORTER_OTLP_* variables send the spans to agl serve (OTEL_EXPORTER_OTLP_PROTOCOL picks protobuf or
// JSON), OTEL_RESOURCE_ATTRIBUTES names the rollout.
const { NodeSDK } = require("@opentelemetry/sdk-node");
const { OpenAIInstrumentation } = require("@arizeai/openinference-instrumentation-openai");

const instrumentation = new OpenAIInstrumentation();
const sdk = new NodeSDK({ instrumentations: [instrumentation] });  // the exporter: as the environment says
sdk.start();
const openai = require("openai");
instrumentation.manuallyInstrument(openai);

const tools = [{ type: "function", function: { name: "add", description: "Add two integers.",
  parameters: { type: "object", properties: { a: { type: "integer" }, b: { type: "integer" } }, required: ["a", "b"] } } }];

async function main() {
  const client = new openai.OpenAI({ baseURL: process.env.MODEL_BASE_URL, apiKey: "x", maxRetries: 0 });
  const messages = [{ role: "system", content: "Be brief." }, { role: "user", content: "Add 2 and 3." }];
  const first = await client.chat.completions.create({ model: "fake-model", messages, tools });
  const reply = first.choices[0].message;
  const call = reply.tool_calls[0];
  const args = JSON.parse(call.function.arguments);
  messages.push(reply, { role: "tool", tool_call_id: call.id, content: String(args.a + args.b) });
  const second = await client.chat.completions.create({ model: "fake-model", messages, tools });
  console.log(second.choices[0].message.content);
}

main().finally(() => sdk.shutdown());
