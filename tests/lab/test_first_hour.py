"""lab/first_hour reads `make run`'s output as a user sees it: which command started when, and what the terminal
shows below the printed curl command."""

from __future__ import annotations

from lab.first_hour import PHASES, _after, slowest

OUTPUT = [
    ".venv/bin/headbudget train --base minilm --data ag_news --recipe quick --out checkpoints/x --seed 7 \\\n",
    "dense: step 12/125, loss 0.700, val 0.000, 8 s\n",
    ".venv/bin/headbudget decider --model checkpoints/x --data ag_news --precision int8\n",
    ".venv/bin/headbudget serve --model checkpoints/x --config service.toml --print-curl\n",
    '{"level": "info", "msg": "ready"}\n',
    "\n",
    "headbudget is ready. Try it (a development key, valid while this server runs):\n",
    "\n",
    "  curl -s 'http://127.0.0.1:8000/classify?budget=0.5' -H 'X-API-Key: hb_x' -d '{\"text\": \"a\"}'\n",
    "  Requests are logged to /tmp/logs/access.log; Ctrl-C stops the server.\n",
    "  budget=auto is being calibrated in the background (about a minute; /tmp/logs/decider.log); until then it "
    "answers 503.\n",
    "\n",
]


def test_each_phase_starts_at_its_command() -> None:
    starts = {name: next((i for i, line in enumerate(OUTPUT) if pattern.search(line)), None)
              for name, pattern in PHASES}
    assert starts == {"install": None, "train": 0, "decider": 2, "serve_start": 3, "ready": 6}


def test_nothing_but_the_note_below_the_curl_command() -> None:
    curl = OUTPUT[8].strip()
    assert _after(OUTPUT, curl) == []
    assert _after([*OUTPUT, '{"msg": "request", "path": "/classify"}\n'], curl) == ['{"msg": "request", "path": "/classify"}']


def test_the_slowest_tests_are_read_from_make_tests_log() -> None:
    log = ("....                                  [100%]\n"
           "============================= slowest 15 durations =============================\n"
           "61.44s setup    tests/training/test_cli.py::test_smoke_trains_and_sweeps\n"
           "20.93s call     tests/training/test_cli.py::test_bad_input_one_line[args6-does not exist]\n"
           "1045 passed, 1 skipped in 506.63s (0:08:26)\n")
    assert slowest(log) == {
        "setup tests/training/test_cli.py::test_smoke_trains_and_sweeps": 61.44,
        "call tests/training/test_cli.py::test_bad_input_one_line[args6-does not exist]": 20.93,  # a space in the id
    }
