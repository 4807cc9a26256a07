// The shape every subcommand shares, and the helpers they all use. Kept apart from the command
// table (commands.ts) so that a command module never imports the table that lists it.
import { InvalidArgumentError, parseRange, type Range } from "@moeswarm/core";
import { type ByteSource, fileSource, httpSource } from "../byte-source.js";
import { parseByteSize } from "../plan/units.js";
import type { CliIo } from "./io.js";

export type Flags = Record<string, string | boolean | undefined>;

export interface CommandContext {
  readonly io: CliIo;
  readonly positionals: readonly string[];
  readonly flags: Flags;
  readonly json: boolean;
  readonly signal: AbortSignal;
}

export interface CommandOption {
  readonly type: "string" | "boolean";
  readonly short?: string;
  readonly description: string;
}

/** One subcommand: `moeswarm-shard <name> ...`. Add an entry to COMMANDS to add a subcommand. */
export interface Command {
  readonly name: string;
  readonly summary: string;
  readonly usage: string;
  readonly options: Readonly<Record<string, CommandOption>>;
  run(ctx: CommandContext): Promise<void>;
}

/** A mistake in the command line (exit status 2), as opposed to a failure of the work (1). */
export function usageError(message: string): InvalidArgumentError {
  return new InvalidArgumentError(message, { details: { usage: true } });
}

export function isUsageError(error: unknown): boolean {
  return (
    error instanceof InvalidArgumentError &&
    (error.code === "MOESWARM_INVALID_RANGE" ||
      (error.details as { usage?: unknown } | undefined)?.usage === true)
  );
}

export function positional(ctx: CommandContext, what: string): string {
  const [value, ...rest] = ctx.positionals;
  if (value === undefined) throw usageError(`missing <${what}>`);
  if (rest.length > 0) throw usageError(`unexpected argument ${JSON.stringify(rest[0])}`);
  return value;
}

export function stringFlag(ctx: CommandContext, name: string): string | undefined {
  const v = ctx.flags[name];
  return typeof v === "string" ? v : undefined;
}

/** The `--file-size` option: a header-only GGUF (the first bytes of a large model) read as that file. */
export const FILE_SIZE_OPTION: CommandOption = {
  type: "string",
  description:
    "the real file's size (bytes, 70GiB): read a header-only GGUF, such as the first MiBs of a large model, as that file",
};

/** `--file-size` as readGguf's fileSize; undefined when not given. */
export function fileSizeFlag(ctx: CommandContext): bigint | undefined {
  const text = stringFlag(ctx, "file-size");
  if (text === undefined) return undefined;
  try {
    return parseByteSize(text, "--file-size");
  } catch (error) {
    throw usageError((error as Error).message);
  }
}

export function write(ctx: CommandContext, text: string): void {
  ctx.io.stdout.write(text.endsWith("\n") ? text : `${text}\n`);
}

/** `0:8`, `3`, or a comma list of them (`0:4,10:12`): the sorted distinct indices. */
export function parseIndexList(text: string, what: string): number[] {
  const out = new Set<number>();
  for (const part of text.split(",")) {
    const r: Range = parseRange(part);
    if (r.end - r.start > 1 << 20) throw usageError(`${what} range ${part} is too large`);
    for (let i = r.start; i < r.end; i++) out.add(i);
  }
  return [...out].sort((a, b) => a - b);
}

export async function openInput(input: string, signal: AbortSignal): Promise<ByteSource> {
  if (/^https?:\/\//i.test(input)) return httpSource(input, { signal });
  return fileSource(input, { signal });
}

/** Sorted indices as ranges: `0:4,7,9:12`. */
export function compact(values: readonly number[]): string {
  const parts: string[] = [];
  let i = 0;
  while (i < values.length) {
    let j = i;
    while (j + 1 < values.length && values[j + 1] === values[j]! + 1) j++;
    parts.push(j > i ? `${values[i]}:${values[j]! + 1}` : String(values[i]));
    i = j + 1;
  }
  return parts.join(",");
}
