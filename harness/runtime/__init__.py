"""Runtime: what every wing runs on. The device policy and torchrun's process group (`distributed`),
the compute precision (`precision`), and progress of long work on a terminal or in a log file
(`progress`).
"""
