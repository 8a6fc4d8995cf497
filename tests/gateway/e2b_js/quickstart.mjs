// E2B's JS quick-start, unchanged: configured only by E2B_API_URL, E2B_SANDBOX_URL and
// E2B_API_KEY. Prints one JSON line of what it saw; tests/gateway/test_e2b.py checks it.
import { Sandbox } from '@e2b/code-interpreter'

const sbx = await Sandbox.create()
const seen = { stdout: [] }
await sbx.runCode('x = 1')
const two = await sbx.runCode('x += 1; x')
const plot = await sbx.runCode(
  'import matplotlib.pyplot as plt\nprint("plotting")\nplt.plot([1, 2])\nplt.show()',
  { onStdout: (m) => seen.stdout.push(m.line) },
)
const failed = await sbx.runCode('1 / 0')
await sbx.files.write('js.txt', 'from js')
const read = await sbx.files.read('js.txt')
const listed = (await sbx.files.list('/home/user')).map((e) => e.name)
let timeout = null
try {
  await sbx.runCode('import time\nwhile True: time.sleep(0.05)', { timeoutMs: 2000 })
} catch (err) {
  timeout = err.name
}
const after = await sbx.runCode('"after"')
const running = (await Sandbox.list().nextItems()).some((s) => s.sandboxId === sbx.sandboxId)
await sbx.kill()
console.log(JSON.stringify({
  two: two.text,
  png: plot.results[0]?.png?.slice(0, 8),
  stdout: seen.stdout,
  error: failed.error && [failed.error.name, failed.error.value],
  read,
  listed,
  timeout,
  after: after.text,
  running,
  alive: await sbx.isRunning(),
}))
