"""Time limits in tests catch hangs only, never slowness.

A test must pass on any CPU, idle or busy (CI's machine may be an AVX2-only one with other work
beside it: the suite ran 4x slower there than here). So no test asserts a duration, and every
subprocess or wait limit is `HANG_S`: at least 10x the slowest run of any command the tests start
(about 2-3 minutes idle on a 2-core machine), so only a process that never finishes reaches it.
"""

HANG_S = 1800
