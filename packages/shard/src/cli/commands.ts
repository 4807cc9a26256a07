import type { Command } from "./command.js";
import { inspect } from "./inspect.js";
import { planCommand } from "./plan.js";
import { manifestCommand, slice, verify } from "./slice-commands.js";
import { synth } from "./synth.js";

/** Every subcommand, in help order. */
export const COMMANDS: readonly Command[] = [inspect, slice, manifestCommand, verify, synth, planCommand];
