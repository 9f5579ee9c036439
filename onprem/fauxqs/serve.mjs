// fauxqs's own launcher (startFauxqs) listens on every interface; the embedded
// profile keeps each emulator on loopback, so this builds the same app and
// listens on 127.0.0.1 only. State is in memory, as LocalStack's is there.
// Usage: node serve.mjs PORT
import { buildApp } from "fauxqs";

const port = Number(process.argv[2]);
if (!Number.isInteger(port) || port <= 0 || port > 65535) {
  console.error(`usage: node serve.mjs PORT (got ${process.argv[2]})`);
  process.exit(2);
}
// Errors only: an internal error is then in make run's sqs.log, not a request line per call.
const app = buildApp({ logger: { level: "error" } });
for (const signal of ["SIGTERM", "SIGINT"]) {
  process.on(signal, () => app.close().then(() => process.exit(0)));
}
await app.listen({ port, host: "127.0.0.1" });
console.log(`fauxqs listening on 127.0.0.1:${port}`);
