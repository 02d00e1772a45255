"""Shared test settings.

Hypothesis: the ``ci`` profile (derandomised, no example database) is used when
``CI`` is set (``.ci/run`` sets it); ``dev`` explores more locally.
``tests/mutants.py`` runs the ``ci`` profile without shrinking (``KVH_MUTANT``
set): the same examples, so the same tests kill a mutant, without the minutes
spent making each failure minimal.
"""

import os
import threading

import pytest
from hypothesis import HealthCheck, Phase, settings

settings.register_profile("ci", derandomize=True, database=None, max_examples=60,
                          deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("mutant", settings.get_profile("ci"),
                          phases=[p for p in Phase if p is not Phase.shrink])
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile("mutant" if os.environ.get("KVH_MUTANT") else "ci" if os.environ.get("CI")
                      else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def wait_for(predicate, timeout, what, interval=0.02):
    """Poll ``predicate`` until it returns something truthy (returned); fail naming ``what``.

    The one way tests wait for something to happen (an event in a log, a
    counter, a state of the fold): never a bare sleep standing in for it.
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}")
        poll_pause(interval)


_PAUSE = threading.Event()  # never set: waiting on it is a pause that needs no clock import


def poll_pause(seconds: float) -> None:
    """The interval of a loop that polls for an event under a bound (`wait_for`, a
    transport pair's ``pump``); never synchronisation on its own."""
    _PAUSE.wait(seconds)


def counting_listener(host: str = "127.0.0.1", port: int = 0):
    """(socket, attempts): ``host:port`` accepting and counting connection attempts.

    Stands at an address that is no P's, so a test can show that nothing
    connected to it (``attempts`` stays empty); close the socket to stop it.
    """
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(64)
    sock.settimeout(0.05)
    attempts: list = []

    def accept() -> None:
        while sock.fileno() != -1:
            try:
                conn, _ = sock.accept()
                attempts.append(1)
                conn.close()
            except (TimeoutError, OSError):
                continue
    threading.Thread(target=accept, daemon=True, name="counting-listener").start()
    return sock, attempts


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "phase(n): run after the module's tests of lower phases (default 0); for "
                   "tests that need all earlier traffic (1) or stop shared engines (2, 3, ...)")
    config.addinivalue_line(
        "markers", "engines(name): the module uses the engines of the session fixture `name` "
                   "(e.g. serve_route); such modules run one after another, and the tests that "
                   "stop the engines (phase >= 2) after every other test that uses them")


STOPS_ENGINES = 2  # phases from here on stop shared engines


def _group(item) -> str:
    marker = item.get_closest_marker("engines")
    return marker.args[0] if marker else item.nodeid.split("::")[0]


def _phase(item) -> int:
    marker = item.get_closest_marker("phase")
    return marker.args[0] if marker else 0


def pytest_collection_modifyitems(config, items):
    """Within each module, run tests by ``phase`` (a stable sort: file order otherwise).

    Modules stay contiguous, so a module-scoped fixture (the serve route's
    engines) is built once.  Modules marked ``engines(name)`` share a
    session-scoped set of engines: they run together, where the first of them
    would run, and the tests that stop those engines (phase >= 2) come last.
    """
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::")[0], i)
        first_seen.setdefault(_group(item), i)

    def key(item):
        phase = _phase(item)
        return (first_seen[_group(item)], phase >= STOPS_ENGINES,
                first_seen[item.nodeid.split("::")[0]], phase)
    items.sort(key=key)


_SHARED_ENGINES: dict[str, object] = {}  # the engines of a session fixture, by its name


def pytest_runtest_teardown(item, nextitem):
    """Stop a group's shared engines once its last test has run (not at the session's end:
    they would sit on memory, and a vLLM CPU worker spins while its engine holds a request)."""
    name = _group(item)
    if name in _SHARED_ENGINES and (nextitem is None or _group(nextitem) != name):
        _SHARED_ENGINES.pop(name).stop()


SERVE_API_KEY = "kvhandoff-test-key"  # the shared route's engines run with --api-key


@pytest.fixture(scope="session")
def serve_route(tmp_path_factory):
    """``vllm serve`` P and D behind the example router, and a plain reference engine, of
    the tiny Llama (test_vllm_serve's `Route`), all three with ``--api-key``, for every
    module marked ``engines("serve_route")``: engine start dominates their cost."""
    from test_vllm_serve import Route

    route = Route(tmp_path_factory.mktemp("serve"), api_key=SERVE_API_KEY)
    _SHARED_ENGINES["serve_route"] = route
    try:
        route.start()
        yield route
    finally:
        _SHARED_ENGINES.pop("serve_route", None)
        route.stop()
