"""A stand-in stage for the observability tests: it reports through the real progress API and
writes one real file per item, like extract does, so status can count them on disk.

usage: python sim_stage.py RUN STAGE TOTAL SECONDS_PER_ITEM MODE [STALL_S] [BUSY_S]
MODE: ok | raise | busy (a long single step with heartbeats, BUSY_S long (default SECONDS_PER_ITEM), then finish)
"""

import sys
import time

from draftsmith import DraftsmithError
from draftsmith.progress import Progress
from draftsmith.rundir import RunDir, atomic_write_bytes


def main() -> None:
    run_path, stage, total, per_item, mode = sys.argv[1:6]
    stall = float(sys.argv[6]) if len(sys.argv) > 6 else 300.0
    busy_s = float(sys.argv[7]) if len(sys.argv) > 7 else float(per_item)
    run = RunDir(run_path).ensure()
    total, per_item = int(total), float(per_item)
    shard = run.stage_dir(stage) / f"rows_0-{total}"
    with Progress(run, stage, total=total, unit="samples", stall_after_s=stall, interval_s=0.2) as prog:
        if mode == "busy":
            with prog.busy("loading target"):
                time.sleep(busy_s)
        for i in range(total):
            if mode == "raise" and i == total // 2:
                raise DraftsmithError(f"sample {i}: simulated failure")
            time.sleep(per_item)
            atomic_write_bytes(shard / f"{i}.safetensors", b"x" * 100)
            prog.advance()
    print("finished", flush=True)


if __name__ == "__main__":
    main()
