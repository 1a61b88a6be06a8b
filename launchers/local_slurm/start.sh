#!/usr/bin/env bash
# A single-node SLURM on 127.0.0.1 with accounting, for tests and for trying the launchers on a laptop or CI box:
# installs Debian's slurm-wlm and munge (and mariadb + slurmdbd for accounting) when missing, writes the configs,
# starts munged, mariadbd, slurmdbd, slurmctld and slurmd, and waits for an idle node. Needs root (a container is
# fine: no systemd or cgroups are used). stop.sh stops exactly the daemons this script started.
#
#   launchers/local_slurm/start.sh && sinfo && sbatch --wrap hostname && launchers/local_slurm/stop.sh
#
# As root (a container) it runs as it is; as another user it runs itself again through sudo (asking its password).
#
# Environment: K3TRAIN_SLURM_STATE (default /tmp/k3train-slurm: pid list, logs, spool), K3TRAIN_SLURM_CPUS (the
# node's CPUs, default nproc), K3TRAIN_SLURM_DEADLINE_S (how long to wait for the idle node, default 60).
# Requeue and signal latency are tuned for tests: credentials expire after 10 s (a requeued job waits ~15 s
# instead of ~2 min) and the scheduler runs every 5 s.
set -euo pipefail

state=${K3TRAIN_SLURM_STATE:-/tmp/k3train-slurm}
cpus=${K3TRAIN_SLURM_CPUS:-$(nproc)}
deadline_s=${K3TRAIN_SLURM_DEADLINE_S:-60}
node=$(hostname -s)
started="$state/started"  # one "name pid" line per daemon this script started; stop.sh reads it

say() { echo "local_slurm: $*" >&2; }
die() { say "error: $*"; exit 1; }

if [[ $(id -u) != 0 ]]; then  # it installs packages and starts daemons
    command -v sudo >/dev/null || die "run it as root: it installs packages and starts daemons (and there is no sudo)"
    exec sudo --preserve-env=K3TRAIN_SLURM_STATE,K3TRAIN_SLURM_CPUS,K3TRAIN_SLURM_DEADLINE_S "$0" "$@"
fi
if scontrol ping >/dev/null 2>&1; then
    say "a SLURM controller is already running; starting nothing"; exit 0
fi
if [[ -s $started ]]; then
    die "$started lists daemons of an earlier start: run launchers/local_slurm/stop.sh first"
fi

# ---- packages -----------------------------------------------------------------------------------------------
packages=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    # A policy-rc.d that answers 101 keeps the packages from starting their daemons (this script starts them).
    policy=/usr/sbin/policy-rc.d own_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && own_policy=1
    fi
    apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; }
    apt_install >"/tmp/k3train-slurm-apt.log" 2>&1 || { apt-get update -q >>"/tmp/k3train-slurm-apt.log" 2>&1 && apt_install >>"/tmp/k3train-slurm-apt.log" 2>&1; } \
        || { ((own_policy)) && rm -f "$policy"; die "apt-get install failed: see /tmp/k3train-slurm-apt.log"; }
    ((own_policy)) && rm -f "$policy"
fi

mkdir -p "$state"/{log,ctld,slurmd}
: >"$started"

# Waits until a command succeeds, at most $1 seconds.
wait_for() {
    local limit=$1; shift
    local end=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < end)) || return 1
        sleep 0.5
    done
}
note_pid() {  # name pidfile: record a daemon this script started
    local pid
    wait_for 20 test -s "$2" || die "$1 wrote no pid file $2 (log: $state/log/$1.log)"
    pid=$(cat "$2")
    echo "$1 $pid" >>"$started"
}

# ---- munge ----------------------------------------------------------------------------------------------------
if ! pgrep -x munged >/dev/null; then
    [[ -s /etc/munge/munge.key ]] || { mungekey --create --keyfile /etc/munge/munge.key 2>/dev/null \
        || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    install -d -o munge -g munge -m 755 /run/munge  # no systemd to create it
    runuser -u munge -- munged --force
    note_pid munged /run/munge/munged.pid
fi

# ---- mariadb + slurmdbd (accounting: sacct, and submitit's job states) -------------------------------------------
if ! pgrep -x mariadbd >/dev/null; then
    install -d -o mysql -g mysql /run/mysqld  # pid and socket in a directory mysql owns, or it fails silently
    [[ -d /var/lib/mysql/mysql ]] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$state/log/mariadb-install.log" 2>&1
    mariadbd --user=mysql --datadir=/var/lib/mysql --bind-address=127.0.0.1 --socket=/run/mysqld/mysqld.sock \
        --pid-file=/run/mysqld/mysqld.pid --log-error=/run/mysqld/error.log >/dev/null 2>&1 &
    note_pid mariadbd /run/mysqld/mysqld.pid
    wait_for 30 mariadb -e "select 1" || die "mariadb did not come up (log: /run/mysqld/error.log)"
fi
mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"

mkdir -p /etc/slurm
cat >/etc/slurm/slurmdbd.conf <<CONF
AuthType=auth/munge
DbdAddr=127.0.0.1
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
PidFile=$state/slurmdbd.pid
LogFile=$state/log/slurmdbd.log
CONF
chmod 600 /etc/slurm/slurmdbd.conf

# ---- slurm.conf -----------------------------------------------------------------------------------------------------
mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
# In /etc/slurm so that sinfo, sbatch and submitit need no SLURM_CONF.
cat >/etc/slurm/slurm.conf <<CONF
# Written by k3train's launchers/local_slurm/start.sh: one node on 127.0.0.1, accounting through slurmdbd.
ClusterName=k3train
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=bf_interval=5,sched_interval=5
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=10
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/slurmd
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
JobAcctGatherType=jobacct_gather/none
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF

rm -f "$state"/slurm{dbd,ctld,d}.pid
slurmdbd
note_pid slurmdbd "$state/slurmdbd.pid"
wait_for 30 sacctmgr -n show cluster || die "slurmdbd does not answer (log: $state/log/slurmdbd.log)"
slurmctld
note_pid slurmctld "$state/slurmctld.pid"
slurmd -N "$node"
note_pid slurmd "$state/slurmd.pid"

idle() { sinfo -h -o %T | grep -qx idle; }
wait_for "$deadline_s" idle || die "no idle node after ${deadline_s}s: $(sinfo -h -o '%N %T %E' 2>&1) (logs: $state/log/)"
say "node $node idle with $cpus CPUs; stop with launchers/local_slurm/stop.sh"
