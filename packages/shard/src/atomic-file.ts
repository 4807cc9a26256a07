import { randomBytes } from "node:crypto";
import { open, rename, unlink } from "node:fs/promises";
import { errorFromSystemError, throwIfAborted } from "@moeswarm/core";

export type FileHandle = Awaited<ReturnType<typeof open>>;

/**
 * Writes `path` through a temporary file beside it, renamed over `path` once complete, so readers
 * never see half a file; on any failure (or abort) the temporary file is removed. File-system
 * errors become IoError with the code that says what happened (MOESWARM_IO_NO_SPACE for a full
 * disk, MOESWARM_IO_ACCESS, MOESWARM_IO_NOT_FOUND...: errorFromSystemError); MoeswarmErrors pass
 * through.
 */
export async function writeFileAtomically(
  path: string,
  write: (handle: FileHandle) => Promise<void>,
  signal?: AbortSignal,
): Promise<void> {
  const tmp = `${path}.${process.pid}-${randomBytes(4).toString("hex")}.tmp`;
  let handle: FileHandle;
  try {
    handle = await open(tmp, "wx");
  } catch (error) {
    throw errorFromSystemError(error, `cannot create ${tmp}`);
  }
  let closed = false;
  try {
    await write(handle);
    closed = true;
    await handle.close();
    throwIfAborted(signal);
    await rename(tmp, path);
  } catch (error) {
    if (!closed) await handle.close().catch(() => undefined);
    await unlink(tmp).catch(() => undefined);
    // a system error (it has a code) says what happened to the disk; anything else passes
    if (error instanceof Error && "code" in error && typeof error.code === "string") {
      throw errorFromSystemError(error, `writing ${path}`);
    }
    throw error;
  }
}

/** Writes all of `chunk` at the handle's position (a write may take only part of it). */
export async function writeAll(handle: FileHandle, chunk: Uint8Array): Promise<void> {
  let done = 0;
  while (done < chunk.byteLength)
    done += (await handle.write(chunk, done, chunk.byteLength - done)).bytesWritten;
}
