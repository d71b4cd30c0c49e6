"""lab/first_hour reads `make run`'s output as a user sees it: which command started when, and what the terminal
shows below the printed curl command."""

from __future__ import annotations

from lab.first_hour import PHASES, _after

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
