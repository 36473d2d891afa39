// E2B's JavaScript SDK, unchanged, against `sandloop serve` (tests/integration/test_e2b_js.py runs
// it with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set, and loopback-only.cjs preloaded).
// It does what a user of the JS SDK does — a command, a terminal (input, resize, exit code, list,
// kill), a server reached through getHost — and prints what it saw as one JSON line for the test.
import http from "node:http";
import { CommandExitError, Sandbox } from "e2b";

const seen = {};
const text = (chunks) => Buffer.concat(chunks.map((c) => Buffer.from(c))).toString("utf8");
const until = async (what, test, seconds = 60) => {
  const deadline = Date.now() + seconds * 1000;
  for (;;) {
    const value = await test();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`gave up waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 200));
  }
};
// A preview host (<port>-<id>.localhost:<server port>), asked of the server itself: what a
// browser does for *.localhost (this machine's resolver knows no such names).
const viaHost = (host) =>
  new Promise((resolve, reject) => {
    const api = new URL(process.env.E2B_API_URL);
    const req = http.get({ host: "127.0.0.1", port: api.port, path: "/", headers: { host } }, (res) => {
      const body = [];
      res.on("data", (d) => body.push(d));
      res.on("end", () => resolve({ status: res.statusCode, body: text(body) }));
    });
    req.on("error", reject);
    req.setTimeout(30000, () => req.destroy(new Error("preview request timed out")));
  });

const sbx = await Sandbox.create({ timeoutMs: 300_000 });
try {
  seen.command = (await sbx.commands.run("echo js-$((6*7))")).stdout;

  const output = [];
  const term = await sbx.pty.create({
    cols: 80, rows: 24, envs: { ABC: "from-js" }, cwd: "/", onData: (d) => output.push(d),
  });
  seen.listed = (await sbx.commands.list()).some((p) => p.pid === term.pid && p.cmd === "/bin/bash");
  await sbx.pty.sendInput(term.pid, new TextEncoder().encode("echo $ABC-$(tput cols)\n"));
  await until("the first answer", () => text(output).includes("from-js-80"));
  await sbx.pty.resize(term.pid, { cols: 120, rows: 40 });
  // a resize reaches the shell before its next line, but ask until it is seen (bounded)
  await sbx.pty.sendInput(
    term.pid,
    new TextEncoder().encode(
      "for i in $(seq 50); do [ $(tput cols) = 120 ] && break; sleep 0.1; done; echo now-$(tput cols)x$(tput lines)\nexit 5\n",
    ),
  );
  try {
    await term.wait();
    seen.exit = 0;
  } catch (err) {
    if (!(err instanceof CommandExitError)) throw err;
    seen.exit = err.exitCode;
  }
  seen.terminal = text(output);

  // a terminal left (disconnect), connected to again, then killed
  const sleeper = await sbx.pty.create({ cols: 40, rows: 10, onData: () => {} });
  await sleeper.disconnect();
  const again = [];
  const back = await sbx.pty.connect(sleeper.pid, { onData: (d) => again.push(d) });
  await sbx.pty.sendInput(back.pid, new TextEncoder().encode("echo back-$((40+2))\n"));
  await until("the reconnected terminal's answer", () => text(again).includes("back-42"));
  seen.reconnected = back.pid === sleeper.pid;
  seen.killed = await sbx.pty.kill(sleeper.pid);
  seen.killedAgain = await sbx.pty.kill(sleeper.pid);

  await sbx.commands.run("cd /tmp && echo served-by-js > index.html && python3 -m http.server 8000", {
    background: true,
  });
  seen.host = sbx.getHost(8000);
  const api = new URL(process.env.E2B_API_URL);
  const page = await until("the server in the sandbox", async () => {
    const r = await viaHost(`${seen.host.split(":")[0]}:${api.port}`);
    return r.status === 502 ? null : r;
  });
  seen.preview = page;
  seen.closedPort = (await viaHost(`8999-${sbx.sandboxId}.localhost:${api.port}`)).status;
} finally {
  await sbx.kill();
}
seen.alive = await Sandbox.list().nextItems().then((items) => items.some((i) => i.sandboxId === sbx.sandboxId));
console.log(JSON.stringify(seen));
