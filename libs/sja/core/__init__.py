"""The decision core: pure functions the services and the simulator both call.

Importing it has no side effects. Where it is built, the same modules compiled with mypyc are used
by a process that asks for them when it starts (``sja.accel.use_compiled_core``).
"""
