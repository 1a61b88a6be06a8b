#!/usr/bin/env bash
# Stops the daemons launchers/local_slurm/start.sh started (and only those), newest first, each with SIGTERM and a
# deadline before SIGKILL. Packages and configs stay, so the next start.sh is quick.
set -euo pipefail
if [[ $(id -u) != 0 ]]; then  # the daemons are root's, as start.sh started them
    command -v sudo >/dev/null || { echo "local_slurm: error: run it as root (there is no sudo)" >&2; exit 1; }
    exec sudo --preserve-env=K3TRAIN_SLURM_STATE "$0" "$@"
fi

state=${K3TRAIN_SLURM_STATE:-/tmp/k3train-slurm}
started="$state/started"
[[ -s $started ]] || { echo "local_slurm: nothing to stop ($started is empty or missing)" >&2; exit 0; }

alive() { kill -0 "$1" 2>/dev/null; }
tac "$started" | while read -r name pid; do
    # Only the process that start.sh recorded: the pid must still run the same program.
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || continue
    kill -TERM "$pid"
    for _ in $(seq 40); do alive "$pid" || break; sleep 0.25; done
    alive "$pid" && kill -KILL "$pid"
    echo "local_slurm: stopped $name ($pid)" >&2
done
: >"$started"
