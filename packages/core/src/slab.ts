// Fresh memory is the main cost of producing buffers (page faults, allocator calls), far more
// than copying into it. Like Node's own Buffer pool, buffers are carved out of larger slabs: a
// slab holds at least four buffers of the size that created it (buffers above 1 MiB get memory
// of their own), and is freed once all buffers cut from it are unreachable. Buffers start at
// multiples of 8 bytes. As with Node's pool, a buffer's `.buffer` spans the whole slab: send
// the view, never its ArrayBuffer. Slabs are zero-filled (calloc: free for fresh pages) so that
// no stale process memory is ever reachable that way.

const MIN_SLAB_BYTES = 64 * 1024;
// Above this a buffer gets memory of its own: four 64 MiB frames per slab would waste too much.
const MAX_SHARED_BYTES = 1024 * 1024;

export class Slab {
  private buffer: Buffer = Buffer.alloc(0);
  private pos = 0;

  /** A view of at least `bytes` free bytes at the slab's current position (not yet taken). */
  room(bytes: number): Buffer {
    if (this.buffer.byteLength - this.pos < bytes) {
      this.buffer = Buffer.alloc(bytes > MAX_SHARED_BYTES ? bytes : Math.max(MIN_SLAB_BYTES, 4 * bytes));
      this.pos = 0;
    }
    return this.buffer.subarray(this.pos);
  }

  /** Takes `bytes` bytes of the view `room` returned. */
  take(bytes: number): void {
    this.pos = Math.min(this.buffer.byteLength, this.pos + ((bytes + 7) & ~7));
  }

  /** A buffer of `bytes` bytes. */
  alloc(bytes: number): Buffer {
    const out = this.room(bytes).subarray(0, bytes);
    this.take(bytes);
    return out;
  }
}
