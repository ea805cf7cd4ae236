"""A job's code through the gateway (a real nats-server; the control plane in this process): uploaded
in chunks on the tenant's own subject, checked, kept in the object store ``sja-code`` as the
tenant's, and required by a ``command`` job that names it."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import msgspec
import nats.js.errors
import pytest

from sja.client import ApiError, SjaClient
from sja.protocol import messages as m
from sja.workloads import codepack
from tests.integration.gateway.test_tenant_code import control_plane

pytestmark = pytest.mark.timeout(120)


def archive(size: int) -> bytes:
    """A zip of ``size`` bytes of noise (it does not compress: several chunks at 1 MiB a message)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("main.py", "print('hello')\n")
        z.writestr("data.bin", os.urandom(size))
    return buf.getvalue()


def spec(tenant: str, code: str) -> m.JobSpec:
    return m.JobSpec(
        name="with-code",
        tenant=tenant,
        workload="command",
        params={"argv": ["python", "main.py"], "units": 4, "code": code},
    )


async def test_code_is_uploaded_in_chunks_kept_once_and_required_by_the_jobs_naming_it(
    nats_url: str, tmp_path: Path
) -> None:
    data = archive(2_500_000)
    async with control_plane(nats_url, tmp_path) as client:
        assert client.nc.max_payload < len(data), "the archive takes several chunks"
        ref = await client.upload_code("alice", data)
        assert ref == "sha256:" + codepack.digest(data)
        store = await client.nc.jetstream().object_store(codepack.BUCKET)
        kept = await store.get(codepack.object_name("alice", codepack.digest(data)))
        assert kept.data == data
        names = [o.name for o in await store.list() if not o.deleted]
        assert names == [codepack.object_name("alice", codepack.digest(data))], "no part left behind"

        # The same code again: nothing is sent but the question.
        sent: list[int] = []
        real = client._call

        async def counting(request, req, typ):  # type: ignore[no-untyped-def]
            sent.append(len(req.data))
            return await real(request, req, typ)

        client._call = counting  # type: ignore[method-assign]
        assert await client.upload_code("alice", data) == ref
        assert sent == [0]
        client._call = real  # type: ignore[method-assign]

        ack = await client.submit(spec("alice", ref))
        assert not ack.duplicate
        # Another tenant cannot name it (it never uploaded it), nor can anyone name code never sent.
        for tenant, code in (("bob", ref), ("alice", "sha256:" + "0" * 64)):
            with pytest.raises(ApiError) as e:
                await client.submit(spec(tenant, code))
            assert e.value.error.field == "params.code"
            assert f"no code {code} uploaded for tenant {tenant!r}" in e.value.error.message


async def test_an_archive_that_is_no_acceptable_code_is_refused_and_nothing_is_kept(
    nats_url: str, tmp_path: Path
) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("../outside.py", "x")
    async with control_plane(nats_url, tmp_path) as client:
        for bad, why in ((b"not a zip at all", "not a zip archive"), (buf.getvalue(), "stay inside")):
            with pytest.raises(ApiError) as e:
                await client.upload_code("alice", bad)
            assert e.value.error.field == "code" and why in e.value.error.message
        store = await client.nc.jetstream().object_store(codepack.BUCKET)
        try:
            objects = await store.list()
        except nats.js.errors.NotFoundError:  # an empty store
            objects = []
        assert [o.name for o in objects if not o.deleted] == [], "the refused parts are dropped"


async def test_a_tenant_uploads_only_its_own_code(nats_url: str, tmp_path: Path) -> None:
    data = archive(1000)
    async with control_plane(nats_url, tmp_path) as operator:
        alice = SjaClient(operator.nc, tenant="alice")
        with pytest.raises(ApiError) as e:
            await alice.upload_code("bob", data)
        assert e.value.error.code == "forbidden"
        ref = await alice.upload_code("alice", data)
        assert (await alice.submit(spec("alice", ref))).job_id


async def test_an_interpreter_that_is_no_absolute_path_is_refused_at_submission(
    nats_url: str, tmp_path: Path
) -> None:
    """The gateway cannot see the executors' file system: it takes an absolute path (``sja submit``
    checks that it exists where it runs; each executor, that it exists on its node)."""
    async with control_plane(nats_url, tmp_path) as client:
        params = {"argv": ["python"], "units": 2, "python": "bin/py"}
        bad = m.JobSpec(name="rel", tenant="t", workload="command", params=params)
        with pytest.raises(ApiError) as e:
            await client.submit(bad)
        assert e.value.error.field == "params.python" and "absolute path" in e.value.error.message
        good = msgspec.structs.replace(bad, params={**bad.params, "python": "/opt/elsewhere/bin/python"})
        assert (await client.submit(good)).job_id
