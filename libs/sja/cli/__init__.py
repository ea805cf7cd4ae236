"""The ``sja`` command line: where the services, the simulator and the demo start.

A process started here uses the compiled decision core when it is built (``sja.accel``), asked for
before any of the core's modules is imported.
"""

from sja.accel import use_compiled_core

use_compiled_core()
