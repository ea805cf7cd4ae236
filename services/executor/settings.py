"""The executor's settings (``SJA_*`` variables, ``docs/operations.md``)."""

from __future__ import annotations

import msgspec

from sja.bus.settings import BaseSettings
from sja.execution.sandbox import SandboxSettings


class ExecutorSettings(BaseSettings, frozen=True, kw_only=True):
    node: str = "local"
    ray_address: str = ""
    """Empty: start a local Ray for this node. Otherwise the address of a Ray cluster."""
    ray_num_cpus: int = 0
    """CPUs to give a local Ray (0: Ray's default)."""
    grace_s: float = 2.0
    """Margin on a busy slice's lease past its time cap before the advertiser reclaims it."""
    kill_margin_s: float = 0.5
    """How far past its time cap a subjob may run before it is stopped and reported ``timeout``."""
    wait_for_slices_s: float = 30.0
    slice_refresh_s: float = 5.0
    """How often the node's slices are read again: a slice a re-cut made (or one back from offline)
    gets an actor, one gone offline loses its idle actor, one whose MIG device changed gets a new one."""
    preload: str = ""
    """Modules every slice actor imports when it starts (``torch`` on GPU nodes): their files are
    read into the page cache before the first subjob needs them. Each subjob still imports them in
    its own sandboxed interpreter, and that is part of its measured start-up."""
    state_url: str = ""
    """Where checkpoints of ``state_url_min_mib`` or more go instead of the object store: a
    directory every node sees, or a URL ``fsspec`` opens (``sja.workloads.statestore``). Empty: all
    go to the object store."""
    state_url_min_mib: float = 64.0
    state_max_mib: float = 512.0
    """A subjob whose output state (checkpoint blob) is larger than this fails, with the reason,
    before anything is stored; 0: no limit."""
    tenant_state_max_mib: float = 8192.0
    """A tenant's states held in the object store ``sja-checkpoints`` together may not pass this: a
    subjob whose state would fails, with the reason, before it is stored (counted from the store at
    most ``checkpoints.TENANT_USAGE_REFRESH_S`` ago, plus this executor's own writes since); 0: no limit."""
    checkpoint_store_max_mib: float = 20480.0
    """The object store ``sja-checkpoints`` is created with this size limit (its ``max_bytes``), so
    states cannot fill the JetStream storage the streams share; 0: none. A store that exists keeps
    its own (``nats stream edit OBJ_sja-checkpoints --max-bytes``)."""
    warm_grace_s: float = 10.0
    """How long a warm ``command`` job's program is kept alive after its subjob for the job's next
    subjob on the same slice (``sja.execution.warm``); 0: never kept."""
    sandbox: SandboxSettings = msgspec.field(default_factory=SandboxSettings)
    """How subjobs are isolated (``SJA_SANDBOX``, ``SJA_SANDBOX_*``; ``sja.execution.sandbox``)."""
