#!/usr/bin/env node
// Merges the hop stamps that MOESWARM_TRACE=<dir> made every process write (core's traceHop, the
// native moeswarm_trace_hop) into one timeline and prints, for each transition "hop A -> next
// hop B" of that timeline, how often it happened and its p50/p90 in microseconds. On a quiet
// machine with one request in flight at a time (a decode), the transitions are the hops of a
// round trip: plugin.send -> bridge.in -> bridge.dispatch -> rc.request -> hub.in -> ...
//
//   MOESWARM_TRACE=/tmp/tr pnpm demo && node tools/trace-report.mjs /tmp/tr
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";

const dir = process.argv[2];
if (!dir) {
  console.error("usage: node tools/trace-report.mjs <trace dir>");
  process.exit(2);
}
const events = [];
for (const name of readdirSync(dir)) {
  if (!/^trace-\d+\.tsv$/.test(name)) continue;
  for (const line of readFileSync(join(dir, name), "utf8").split("\n")) {
    if (line === "" || line.startsWith("#")) continue;
    const [hop, ns] = line.split("\t");
    if (hop && ns) events.push({ hop, ns: BigInt(ns) });
  }
}
events.sort((a, b) => (a.ns < b.ns ? -1 : a.ns > b.ns ? 1 : 0));
const pairs = new Map();
for (let i = 1; i < events.length; i++) {
  const a = events[i - 1];
  const b = events[i];
  const key = `${a.hop} -> ${b.hop}`;
  let list = pairs.get(key);
  if (!list) {
    list = [];
    pairs.set(key, list);
  }
  list.push(Number(b.ns - a.ns) / 1e3);
}
const q = (s, p) => s[Math.min(s.length - 1, Math.floor(p * s.length))];
const rows = [...pairs]
  .map(([key, d]) => {
    d.sort((x, y) => x - y);
    return { key, n: d.length, p50: q(d, 0.5), p90: q(d, 0.9), total: d.reduce((s, x) => s + x, 0) };
  })
  .sort((x, y) => y.total - x.total);
console.log(`${events.length} stamps; transitions by total time`);
console.log(
  `${"transition".padEnd(44)} ${"count".padStart(7)} ${"p50 us".padStart(9)} ${"p90 us".padStart(9)}`,
);
for (const r of rows.slice(0, 40)) {
  console.log(
    `${r.key.padEnd(44)} ${String(r.n).padStart(7)} ${r.p50.toFixed(1).padStart(9)} ${r.p90.toFixed(1).padStart(9)}`,
  );
}
