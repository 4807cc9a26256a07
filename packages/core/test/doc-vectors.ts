// Reads the test vectors and the canonical key order out of docs/protocol.md, so that the tests
// check the document itself (an implementer's only source) rather than a copy of it.
import { readFileSync } from "node:fs";

export const PROTOCOL_DOC = readFileSync(new URL("../../../docs/protocol.md", import.meta.url), "utf8");

export interface DocVector {
  name: string;
  json: Record<string, unknown>;
  bytes: Uint8Array;
}

export function docVectors(doc = PROTOCOL_DOC): DocVector[] {
  const out: DocVector[] = [];
  const re = /^### Vector `([^`]+)`\n[\s\S]*?```json\n([\s\S]*?)```\n[\s\S]*?```hex\n([\s\S]*?)```/gm;
  for (const m of doc.matchAll(re)) {
    const hex = m[3]!.replace(/\s+/g, "");
    if (!/^([0-9a-f]{2})+$/.test(hex)) throw new Error(`vector ${m[1]}: bad hex`);
    out.push({ name: m[1]!, json: JSON.parse(m[2]!), bytes: Uint8Array.from(Buffer.from(hex, "hex")) });
  }
  return out;
}

/** Canonical key order per frame type, from the field tables of section 4 (after `t`, `v`). */
export function docKeyOrder(doc = PROTOCOL_DOC): Record<string, string[]> {
  const order: Record<string, string[]> = {};
  const sections = doc.split(/^### 4\.\d+ /m).slice(1);
  for (const section of sections) {
    const title = section.split("\n")[0]!.split(":")[0]!;
    const types = [...title.matchAll(/`([a-z]+)`/g)].map((m) => m[1]!);
    // the first table of the section lists the frame's fields; `caps` has its own table
    const tables = section.split(/\n\n/).filter((b) => b.trimStart().startsWith("| key"));
    const keysOf = (table: string) =>
      table
        .split("\n")
        .slice(2)
        .map((row) => /^\|\s*`([A-Za-z]+)`/.exec(row)?.[1])
        .filter((k): k is string => k !== undefined);
    for (const t of types) order[t] = keysOf(tables[0]!);
    if (types.includes("hello")) order.caps = keysOf(tables[1]!);
  }
  return order;
}
