"""The decision core: pure functions the services and the simulator both call.

Compiled with mypyc when built (``sja.accel``): the compiled modules are then found first.
"""

from sja import accel

accel.enable(__path__)
