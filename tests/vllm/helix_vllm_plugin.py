"""A pytest plugin that runs vLLM's own scheduler tests against helix_kv's adapter.

Loaded into a pytest session inside vLLM's source tree (``-p helix_vllm_plugin``, with this
directory on ``PYTHONPATH``): before the test modules are collected it wraps the
``create_scheduler`` helper of vLLM's ``tests/v1/core/utils.py`` so that a test that builds
the default scheduler (it passes no ``scheduler_cls``) builds
:class:`helix_kv.integrations.vllm.HelixScheduler`, through the helper's own ``scheduler_cls``
argument. Nothing of vLLM's files is edited. ``run_vllm_suites.py`` runs it.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from typing import Any

#: Helpers of vLLM's tests that build ``vllm.v1.core.sched.scheduler.Scheduler`` by name
#: instead of taking a class: (module, helper). While such a helper runs, the module's
#: ``Scheduler`` is helix_kv's adapter (the class a test sees elsewhere is unchanged).
BUILT_BY_NAME = (
    ("tests.v1.core.test_scheduler", "create_scheduler_with_priority"),
    ("tests.v1.core.test_priority_preemption_bug", "build_scheduler"),
)


#: Whether the running test built helix_kv's adapter (reset as each test starts).
_BUILT = {"adapter": False}


def pytest_runtest_setup(item: Any) -> None:
    _BUILT["adapter"] = False


def pytest_configure(config: Any) -> None:
    from helix_kv.integrations.vllm import HelixScheduler

    original_init = HelixScheduler.__init__

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        _BUILT["adapter"] = True
        original_init(self, *args, **kwargs)

    HelixScheduler.__init__ = init  # type: ignore[method-assign]

    utils = importlib.import_module("tests.v1.core.utils")
    original = utils.create_scheduler

    def one_step_ahead(**kwargs: Any) -> Any:
        # vLLM's CPU platform turns async scheduling off in the config a test builds; the
        # test asked for it (as a GPU engine keeps it), so the adapter is built with it on.
        object.__setattr__(kwargs["vllm_config"].scheduler_config, "async_scheduling", True)
        return HelixScheduler(**kwargs)

    @functools.wraps(original)
    def create_scheduler(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("scheduler_cls") is None:
            ahead = kwargs.get("async_scheduling", False)
            kwargs["scheduler_cls"] = one_step_ahead if ahead else HelixScheduler
        return original(*args, **kwargs)

    utils.create_scheduler = create_scheduler
    for module_name, helper in BUILT_BY_NAME:
        _build_with(importlib.import_module(module_name), helper, HelixScheduler)


def _build_with(module: Any, helper: str, scheduler_cls: type) -> None:
    original = getattr(module, helper)

    @functools.wraps(original)
    def build(*args: Any, **kwargs: Any) -> Any:
        saved = module.Scheduler
        module.Scheduler = scheduler_cls
        try:
            return original(*args, **kwargs)
        finally:
            module.Scheduler = saved

    setattr(module, helper, build)


_REPORT: list[dict[str, str]] = []


def pytest_runtest_logreport(report: Any) -> None:
    """Collects each test's outcome and the first line of its failure, for the runner."""
    failed_setup = report.when == "setup" and report.outcome != "passed"
    if report.when != "call" and not failed_setup:
        return
    reason = ""
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
    elif report.outcome == "failed":
        crash = getattr(report.longrepr, "reprcrash", None)
        reason = crash.message.splitlines()[0] if crash is not None else str(report.longrepr)
    _REPORT.append(
        {
            "test": report.nodeid,
            "outcome": report.outcome,
            "reason": reason[:300],
            "built_adapter": _BUILT["adapter"],
        }
    )


def pytest_sessionfinish(session: Any) -> None:
    path = os.environ.get("HELIX_VLLM_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as out:
            json.dump(_REPORT, out, indent=1)
