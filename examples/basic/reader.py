"""Process 2: retrieve what writer.py stored, straight from shared memory, and check it.

python reader.py [tcp://host:port]
"""

from __future__ import annotations

import os
import sys

from common import KEYS, SIZES, ZERO_COPY_KEY, ZERO_COPY_SIZE, server_url, value_for

from maru import MaruHandler


def main() -> int:
    url = server_url()
    keys = [*KEYS, ZERO_COPY_KEY, "example/never-stored"]
    sizes = [*SIZES, ZERO_COPY_SIZE, 0]
    failures = 0
    with MaruHandler(server_url=url, pool_size="4M") as maru:
        # One lookup RPC for all keys; each result is a read-only view of the writer's pages
        # through this process's own mapping of the pool (no copy was made).
        for key, size, info in zip(keys, sizes, maru.batch_retrieve(keys)):
            if info is None:
                expected_missing = key == "example/never-stored"
                print(
                    f"reader[{os.getpid()}]: {key}: not found"
                    + (" (as expected)" if expected_missing else "")
                )
                failures += not expected_missing
                continue
            same = info.view == value_for(key, size)
            print(
                f"reader[{os.getpid()}]: {key}: {info.length} bytes at region {info.region_id} "
                f"page {info.page_index}, read-only={info.view.readonly}, identical={same}"
            )
            failures += not same
        # Clean up after the example: deleting the last key frees the writer's region.
        deleted = maru.batch_delete(keys[:-1])
        print(f"reader: deleted {sum(deleted)} keys")
    print("reader: OK" if failures == 0 else f"reader: {failures} problems")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
