"""Process 1: store values in Maru, then exit. The values outlive this process.

python writer.py [tcp://host:port]
"""

from __future__ import annotations

import os
import sys

from common import KEYS, SIZES, ZERO_COPY_KEY, ZERO_COPY_SIZE, server_url, value_for

from maru import MaruHandler


def main() -> int:
    url = server_url()
    # Each instance gets its own region of the pool (here 64 MiB) and writes into it directly.
    with MaruHandler(server_url=url, pool_size="64M") as maru:
        # 1) Copying store: one memcpy per value into shared memory, one RPC for the batch.
        values = [value_for(key, size) for key, size in zip(KEYS, SIZES)]
        results = maru.batch_store(KEYS, values)
        for key, size, ok in zip(KEYS, SIZES, results):
            print(f"writer[{os.getpid()}]: stored {key} ({size} bytes): {ok}")

        # 2) Zero-copy store: allocate pages, write into them in place, then register.
        handle = maru.alloc(ZERO_COPY_SIZE)
        if handle is None:
            print("writer: pool full", file=sys.stderr)
            return 1
        handle.buf[:ZERO_COPY_SIZE] = value_for(ZERO_COPY_KEY, ZERO_COPY_SIZE)
        ok = maru.store(ZERO_COPY_KEY, handle=handle, length=ZERO_COPY_SIZE)
        print(
            f"writer[{os.getpid()}]: stored {ZERO_COPY_KEY} "
            f"({ZERO_COPY_SIZE} bytes, zero-copy): {ok}"
        )
        results.append(ok)

        stats = maru.stats()
        print(f"writer: server now holds {stats['keys']} keys in pool {stats['pool']['path']}")
    # Leaving the `with` returns our region to the server: the keys stay readable, and the
    # region is freed once its last key is deleted.
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
