"""The dashboard in a real headless browser: Debian's ``chromium`` driven by Playwright, against the
whole stack as ``sja up`` runs it (every service a process, the dashboard included, a real
nats-server and a local Ray). The page loads, the timeline draws the subjobs of a running job on
its slices, and a job's page shows the gateway's explanation of why it waits; a failed job's page
counts its subjobs by how they ended, keeps its traceback's lines and shows what its program wrote
as text (the markup it printed is not made HTML); the jobs on screen have colours of their own. The
browser opens the
address with the operator's token, as ``sja up`` prints it (kept in a cookie from then on); without
it the page is refused. Screenshots are kept
under ``out/ui/`` (``dashboard.png``, ``job.png``) as the test's artifacts.

``.ci/run`` installs chromium when it is missing; without it (a machine set up by hand) the test is
skipped, saying so. Playwright's own browser download is not used: it launches the system's."""

from __future__ import annotations

import asyncio
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from sja import dashauth
from sja.bus.natsd import free_port
from sja.client import SjaClient
from sja.protocol.messages import JobSpec, MemoryDecl
from sja.stack import UP_ORDER, LocalStack
from tests.integration.accepted import accepted_earlier

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "out" / "ui"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

SETTINGS = {"SJA_HORIZON_S": "3.0", "SJA_POLICY": "fair", "SJA_RAY_NUM_CPUS": "2"}

RUNNING = JobSpec(
    name="shown",
    tenant="alpha",
    workload="montecarlo",
    max_parallel=2,
    params={"units": 400, "samples_per_unit": 200_000, "seed": 5},
)
TOO_BIG = JobSpec(
    name="too-big",
    tenant="beta",
    workload="montecarlo",
    params={"units": 10},
    memory=MemoryDecl(base_mib=100_000, per_unit_mib=10),
)


# Prints markup (which the page must show as text) and fails with a traceback, every time.
FAILING_PROGRAM = textwrap.dedent(
    """
    print("<b id='injected'>bold</b>")
    print("second line")
    def train():
        raise ValueError("the data is bad")
    train()
    """
)
FAILING = JobSpec(
    name="fails",
    tenant="alpha",
    workload="command",
    params={"argv": [sys.executable, "-c", FAILING_PROGRAM], "units": 4, "sequential": True},
    memory=MemoryDecl(base_mib=64.0, per_unit_mib=0.0),
)


def chromium_or_skip() -> str:
    found = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    if not found:
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium; .ci/run does it)")
    return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, int, str]]:
    chromium_or_skip()
    out = tmp_path_factory.mktemp("ui-stack")
    port = free_port()
    secret_file = out / "dashboard.secret"  # as `sja up` writes it
    secret = dashauth.write_secret(secret_file)
    s = LocalStack(
        out_dir=out,
        env=SETTINGS,
        service_env={
            "ui": {
                "SJA_UI_PORT": str(port),
                "SJA_UI_HOST": "127.0.0.1",
                "SJA_UI_REFRESH_S": "0.5",
                "SJA_UI_TOKEN_FILE": str(secret_file),
            }
        },
    )
    try:
        s.start(order=UP_ORDER)
        asyncio.run(s.wait_ready())
        yield s, port, dashauth.operator_token(secret)
    finally:
        s.stop()


async def submit(url: str) -> tuple[str, str, str]:
    client = await SjaClient.connect(url)
    try:
        running = (await client.submit(RUNNING)).job_id
        failing = (await client.submit(FAILING)).job_id
        # The gateway refuses a job no slice holds: written as it accepted one before a GPU was lost.
        return running, await accepted_earlier(client.nc, TOO_BIG), failing
    finally:
        await client.close()


def test_the_dashboard_shows_the_timeline_and_a_jobs_explanation(stack: tuple[LocalStack, int, str]) -> None:
    from playwright.sync_api import sync_playwright

    executable = chromium_or_skip()
    s, port, token = stack
    running_id, big_id, failing_id = asyncio.run(submit(s.nats_url))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            # Wait on what the page shows, however long the stack takes (pytest's timeout bounds it).
            page.set_default_timeout(0)
            refused = page.goto(f"http://127.0.0.1:{port}/")
            assert refused is not None and refused.status == 401
            page.goto(f"http://127.0.0.1:{port}/?token={token}")
            assert page.url == f"http://127.0.0.1:{port}/"  # the token went into the cookie
            bars = page.locator(f'#timeline rect.subjob[data-job="{running_id}"]')
            bars.first.wait_for()
            slices = page.locator("#timeline text.slice").all_text_contents()
            assert any("3g.20gb" in t for t in slices), slices
            drawn_on = bars.first.get_attribute("data-slice")
            assert drawn_on and any(t.startswith(drawn_on) for t in slices)
            page.locator(f'#jobs tr[data-job="{big_id}"]').wait_for()
            page.locator('#tenants tr[data-tenant="alpha"]').wait_for()
            page.locator("#rounds tr.round").first.wait_for()
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
            swatches = page.locator("#jobs tr[data-job] .swatch")
            colours = [swatches.nth(i).get_attribute("style") for i in range(swatches.count())]
            assert len(colours) == 3 and len(set(colours)) == 3, colours

            # The job that fits no slice: its page says why, per window shape.
            page.locator(f'#jobs a.job-link[href="/job/{big_id}"]').click()
            page.wait_for_url(f"**/job/{big_id}")
            summary = page.locator("#explain-summary")
            summary.wait_for()
            assert summary.inner_text().startswith("pending")
            page.locator("#explanation td", has_text="needs").first.wait_for()
            page.locator("#explanation", has_text="fits none of the slices").wait_for()
            page.screenshot(path=str(ARTIFACTS / "job.png"), full_page=True)

            # The running job's page lists its subjobs and the rounds it won.
            page.goto(f"http://127.0.0.1:{port}/job/{running_id}")
            page.locator("#subjobs td", has_text=running_id).first.wait_for()
            page.locator("#job-rounds tr.round").first.wait_for()

            # The failed job's page: its subjobs by how they ended, its traceback's lines, and what
            # its program printed, as text.
            page.goto(f"http://127.0.0.1:{port}/job/{failing_id}")
            page.locator("#job-error").wait_for()
            tally = page.locator("#subjob-tally").inner_text()
            assert "failed" in tally and "done" not in tally, tally
            error = page.locator("#job-error").inner_text()
            assert "\n" in error.strip() and "ValueError: the data is bad" in error, error
            stdout = page.locator("#output pre.stdout").first
            stdout.wait_for()
            assert "<b id='injected'>bold</b>\nsecond line" in stdout.inner_text()
            assert page.locator("#injected").count() == 0, "a program's output became HTML"
            stderr = page.locator("#output pre.stderr").first.inner_text()
            assert "Traceback (most recent call last):\n" in stderr, stderr
            page.screenshot(path=str(ARTIFACTS / "failed-job.png"), full_page=True)
        finally:
            browser.close()
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
