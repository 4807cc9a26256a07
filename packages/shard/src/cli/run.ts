import { parseArgs } from "node:util";
import { describeError } from "@moeswarm/core";
import { type Command, type CommandOption, isUsageError, usageError } from "./command.js";
import { COMMANDS } from "./commands.js";
import type { CliIo } from "./io.js";

export const CLI_NAME = "moeswarm-shard";

const GLOBAL_OPTIONS: Record<string, CommandOption> = {
  json: { type: "boolean", description: "machine-readable output on stdout" },
  help: { type: "boolean", short: "h", description: "show help" },
};

function optionHelp(options: Readonly<Record<string, CommandOption>>): string[] {
  return Object.entries(options).map(([name, o]) => {
    const flag = `${o.short ? `-${o.short}, ` : "    "}--${name}${o.type === "string" ? " <value>" : ""}`;
    return `  ${flag.padEnd(28)} ${o.description}`;
  });
}

export function helpText(command?: Command): string {
  if (command) {
    return [
      `usage: ${CLI_NAME} ${command.usage}`,
      "",
      command.summary,
      "",
      "options:",
      ...optionHelp({ ...command.options, ...GLOBAL_OPTIONS }),
      "",
    ].join("\n");
  }
  return [
    `usage: ${CLI_NAME} <command> [options]`,
    "",
    "commands:",
    ...COMMANDS.map((c) => `  ${c.name.padEnd(10)} ${c.summary}`),
    "",
    `Run \`${CLI_NAME} <command> --help\` for a command's options. Errors print one line with their code and exit 1.`,
    "",
  ].join("\n");
}

/**
 * Runs the CLI with `argv` (without node and the script): 0 on success, 1 on an error (printed as
 * `moeswarm-shard: CODE: message` on stderr, and as `{"error": ...}` on stdout with --json),
 * 2 on a usage error.
 */
export async function runCli(
  argv: readonly string[],
  io: CliIo,
  signal: AbortSignal = new AbortController().signal,
): Promise<number> {
  const [name, ...rest] = argv;
  if (name === undefined || name === "--help" || name === "-h" || name === "help") {
    io.stdout.write(
      helpText(name === "help" && rest[0] ? COMMANDS.find((c) => c.name === rest[0]) : undefined),
    );
    return name === undefined ? 2 : 0;
  }
  const json = rest.includes("--json");
  const fail = (error: unknown, exitCode: number): number => {
    const { code, message, details } = describeError(error);
    io.stderr.write(`${CLI_NAME}: ${code}: ${message.replace(/\s*\n\s*/g, " ")}\n`);
    if (json) io.stdout.write(`${JSON.stringify({ error: { code, message, details } })}\n`);
    return exitCode;
  };
  const command = COMMANDS.find((c) => c.name === name);
  if (!command) {
    return fail(usageError(`unknown command ${JSON.stringify(name)}; try --help`), 2);
  }
  let parsed: ReturnType<typeof parseArgs>;
  try {
    parsed = parseArgs({
      args: [...rest],
      options: { ...command.options, ...GLOBAL_OPTIONS },
      allowPositionals: true,
      strict: true,
    });
  } catch (error) {
    return fail(error, 2);
  }
  if (parsed.values.help === true) {
    io.stdout.write(helpText(command));
    return 0;
  }
  try {
    await command.run({
      io,
      positionals: parsed.positionals,
      flags: parsed.values as Record<string, string | boolean | undefined>,
      json: parsed.values.json === true,
      signal,
    });
    return 0;
  } catch (error) {
    return fail(error, isUsageError(error) ? 2 : 1);
  }
}
