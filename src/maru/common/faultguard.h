/* faultguard: `_memcopy.c`'s fault guard ("faults during a copy") as another extension reaches
 * it. There is one guard in the process: its SIGBUS/SIGSEGV handler and its per-thread jump
 * pointer live in `_memcopy.c` alone (two handlers would each have to chain to the other, and
 * a fault in one's guard could meet the other's). `_memcopy.c` exports `on` and `off` through
 * the capsule MARU_FAULT_GUARD (`maru.common._memcopy.FAULT_GUARD`); `_shmindex.c` runs every
 * read of a reader's table (pool memory, for the in-pool index) under them, so that a pool
 * file truncated under a reader is a fault of that call, not the death of the process.
 *
 * Use: the caller's frame does the sigsetjmp (the jump needs it live), then
 *
 *     sigjmp_buf jump;
 *     if (sigsetjmp(jump, 0))
 *         return FAULTED;              (the guard is off again: the handler cleared it)
 *     guard->on(&jump);
 *     ... loads and stores of the mapping: no allocation, no Python, no lock ...
 *     guard->off();
 *
 * A guard does not nest: `_memcopy.c`'s copies set and clear their own, so a caller turns its
 * guard off before it calls a copy. sigsetjmp(jump, 0) saves no signal mask (no system call):
 * one per call, not per key, costs nanoseconds. */
#ifndef MARU_FAULTGUARD_H
#define MARU_FAULTGUARD_H

#include <setjmp.h>

#define MARU_FAULT_GUARD "maru.common._memcopy.FAULT_GUARD"

typedef struct {
    void (*on)(sigjmp_buf *jump); /* a fault in this thread jumps to `jump` from now on */
    void (*off)(void);            /* until this */
} MaruFaultGuard;

#endif
