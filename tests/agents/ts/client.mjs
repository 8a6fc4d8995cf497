// The official MCP TypeScript SDK client against kernelhub's MCP server, run by
// tests/gateway/test_mcp.py: `node client.mjs stdio <python>` or `node client.mjs http <url>`.
// Prints one JSON object with what it saw; the Python test asserts on it.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import {
  ElicitRequestSchema,
  LoggingMessageNotificationSchema,
} from "@modelcontextprotocol/sdk/types.js";

const [mode, target] = process.argv.slice(2);
const transport =
  mode === "stdio"
    ? new StdioClientTransport({
        command: target,
        args: ["-m", "kernelhub.agents.mcp_server"],
        env: process.env,
        stderr: "ignore",
      })
    : new StreamableHTTPClientTransport(new URL(target), {
        // the HTTP transport runs tools as the caller's kernelhub token
        requestInit: { headers: { Authorization: `Bearer ${process.env.KERNELHUB_TOKEN}` } },
      });

const client = new Client(
  { name: "kernelhub-ts-test", version: "1.0.0" },
  { capabilities: { elicitation: {} } },
);
const seen = { logs: [], progress: [], asked: [] };
const answers = [{ value: "Ada" }, { answer: true }];
client.setRequestHandler(ElicitRequestSchema, async (request) => {
  seen.asked.push(request.params.message);
  return { action: "accept", content: answers.shift() };
});
client.setNotificationHandler(LoggingMessageNotificationSchema, (n) => {
  seen.logs.push([Date.now(), String(n.params.data)]);
});

const text = (result) =>
  result.content.filter((c) => c.type === "text").map((c) => c.text).join("");
const call = async (code, options = {}) =>
  text(
    await client.callTool({ name: "execute_python", arguments: { code } }, undefined, {
      timeout: 120000,
      ...options,
    }),
  );

await client.connect(transport);
const out = {};
const started = Date.now();
out.printed = await call(
  "import time\nfor i in range(8):\n    print('tick', i, flush=True)\n    time.sleep(0.25)",
  { onprogress: (p) => seen.progress.push([Date.now(), p.message ?? ""]) },
);
out.printed_ms = [started, Date.now()];
out.asked = await call("name = input('name? ')\nprint('hi', name, confirm('go on?'))");
await call("kept = 41");
try {
  await call("while True: pass", { timeout: 2000 });
  out.cancelled = "not cancelled";
} catch (error) {
  out.cancelled = String(error);
}
const t0 = Date.now();
out.after = await call("print(kept + 1)");
out.after_ms = Date.now() - t0;
out.oom = await call("blocks = []\nwhile True:\n    blocks.append(bytearray(32 * 2**20))");
out.again = await call("print('alive')");
out.seen = seen;
await client.close();
console.log(JSON.stringify(out));
