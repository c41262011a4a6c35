#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for tests/parallel/test_slurm.py (and by hand):
#     tests/slurm/start.sh [DIR]          DIR: its config, state and logs (default /tmp/kimi-slurm)
#     export SLURM_CONF=DIR/slurm.conf    then sbatch, squeue, scontrol, scancel and sinfo use it
#     tests/slurm/start.sh --stop [DIR]   stops its slurmctld and slurmd, and munged if this script started it
# When sbatch, slurmctld, slurmd or munged is missing it installs Debian's slurm-wlm and munge (as root, with
# apt-get; apt-get update first when apt knows no slurm-wlm). It writes DIR/slurm.conf for this host (its
# CPUs and memory; no cgroups, no accounting database; a requeued job may start again 6 s after its requeue
# instead of SLURM's default 121 s), creates a munge key if there is none, starts munged, slurmctld and
# slurmd, and waits until sinfo shows the node idle. Run again while they run with that config, it does
# nothing. stdout: "SLURM_CONF=DIR/slurm.conf", then "started" or "running" (already up).
# Exit codes: 0 ready; 77 SLURM cannot run here (not root, no apt-get, the install failed); 1 it should have
# started and did not (a daemon's log is quoted). A failure ends with one line on stderr: "slurm: why".
set -uo pipefail
export LC_ALL=C PATH="$PATH:/usr/sbin:/sbin"
STOP=0
if [[ "${1:-}" == --stop ]]; then STOP=1; shift; fi
DIR="${1:-/tmp/kimi-slurm}"
if ! mkdir -p "$DIR" || ! DIR="$(cd "$DIR" && pwd)"; then echo "slurm: cannot create $DIR" >&2; exit 1; fi
CONF="$DIR/slurm.conf"
export SLURM_CONF="$CONF"
cant() { echo "slurm: $*" >&2; exit 77; }
die() { echo "slurm: $*" >&2; exit 1; }
note() { echo "[slurm] $*" >&2; }
tail_of() { tail -n "${2:-6}" "$1" 2>/dev/null | tr -s '\n' ' ' | cut -c1-1500; }  # a log's end, on one line
alive() {  # DIR/NAME.pid names a running NAME (not a zombie, not a process that got its pid later)
    local pid
    pid="$(cat "$DIR/$1.pid" 2>/dev/null)" && [[ -n "$pid" ]] || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$1" ]] || return 1
    ! grep -q "^State:.*Z" "/proc/$pid/status" 2>/dev/null
}
munge_ok() { command -v munge >/dev/null && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

stop() {  # daemon name: TERM, up to 10 s, then KILL
    if alive "$1"; then
        local pid
        pid="$(cat "$DIR/$1.pid")"
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 100); do alive "$1" || break; sleep 0.1; done
        alive "$1" && kill -KILL "$pid" 2>/dev/null
    fi
    rm -f "$DIR/$1.pid"
}
if [[ $STOP == 1 ]]; then
    stop slurmd
    stop slurmctld
    stop munged  # only when this script started it (DIR/munged.pid)
    note "stopped the daemons of $DIR"
    exit 0
fi

# --- the config of this host --------------------------------------------------------------------------------
HOST="$(hostname -s)"
CPUS="$(getconf _NPROCESSORS_ONLN 2>/dev/null || nproc)"
MEM_KB="$(awk '/^MemTotal:/ {print $2}' /proc/meminfo 2>/dev/null)"
MEMORY="${MEM_KB:+ RealMemory=$((MEM_KB / 1024))}"
config() {
    cat <<CONF
# Written by tests/slurm/start.sh: one node ($HOST), no cgroups, no accounting database.
ClusterName=kimitest
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again cred_expire + 1 s after its requeue (SLURM's default 120, its minimum 5).
AuthInfo=cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Start a job whose begin time has come (a requeued one) within a second, not at the next 30-60 s pass.
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
MinJobAge=60
KillWait=10
InactiveLimit=0
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS$MEMORY State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
}
node_state() { timeout 10 sinfo -h -n "$HOST" -o %T 2>/dev/null | head -n 1; }

# --- already running with this config? ----------------------------------------------------------------------
if [[ -f "$CONF" && "$(cat "$CONF")" == "$(config)" ]] && alive slurmctld && alive slurmd && munge_ok \
    && [[ "$(node_state)" =~ ^(idle|mix|alloc|comp) ]]; then
    note "already running ($CONF)"
    printf 'SLURM_CONF=%s\nrunning\n' "$CONF"
    exit 0
fi
[[ $(id -u) == 0 ]] || cant "starting a SLURM cluster needs root (this is uid $(id -u))"

# --- install ------------------------------------------------------------------------------------------------
missing=()
for cmd in sbatch scontrol slurmctld slurmd munged munge; do
    command -v "$cmd" >/dev/null || missing+=("$cmd")
done
if ((${#missing[@]})); then
    command -v apt-get >/dev/null || cant "no ${missing[*]}, and no apt-get to install slurm-wlm and munge"
    t0=$SECONDS
    export DEBIAN_FRONTEND=noninteractive
    log="$DIR/apt.log"
    : >"$log"
    install() { apt-get install -y -q --no-install-recommends -o Dpkg::Options::=--force-confdef \
                    -o Dpkg::Options::=--force-confold slurm-wlm munge >>"$log" 2>&1; }
    candidate() { apt-cache policy slurm-wlm 2>/dev/null | awk '/Candidate:/ && $2 != "(none)" {print $2}'; }
    if [[ -z "$(candidate)" ]]; then  # a fresh machine has no package lists yet
        apt-get update -q >>"$log" 2>&1 || cant "apt-get update failed: $(tail_of "$log" 3)"
    fi
    if ! install; then  # stale lists name files the mirror no longer has: update once and retry
        { apt-get update -q >>"$log" 2>&1 && install; } \
            || cant "apt-get install slurm-wlm munge failed: $(tail_of "$log" 3)"
    fi
    for cmd in "${missing[@]}"; do
        command -v "$cmd" >/dev/null || die "slurm-wlm and munge are installed, but there is no $cmd"
    done
    note "installed slurm-wlm and munge in $((SECONDS - t0)) s"
fi

# --- munge --------------------------------------------------------------------------------------------------
t0=$SECONDS
if ! munge_ok; then
    id munge >/dev/null 2>&1 || die "there is no munge user (the munge package creates it)"
    if [[ ! -s /etc/munge/munge.key ]]; then
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
        else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi \
            || die "cannot create /etc/munge/munge.key"
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
    chmod 0700 /etc/munge /var/log/munge /var/lib/munge
    chmod 0400 /etc/munge/munge.key
    chmod 0755 /run/munge
    runuser -u munge -- munged --force >"$DIR/munged.out" 2>&1 \
        || die "munged did not start: $(tail_of "$DIR/munged.out" 3) $(tail_of /var/log/munge/munged.log 3)"
    for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
    munge_ok || die "munged runs but does not answer: $(tail_of /var/log/munge/munged.log 4)"
    cp /run/munge/munged.pid "$DIR/munged.pid" 2>/dev/null || true
fi

# --- slurmctld and slurmd -----------------------------------------------------------------------------------
stop slurmd  # ours, with another config or half started
stop slurmctld
mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
config >"$CONF"
start() {  # daemon name, its command line (it forks and writes its pid file)
    local name=$1
    shift
    : >"$DIR/log/$name.log"
    "$@" >"$DIR/log/$name.out" 2>&1 \
        || die "$name did not start: $(tail_of "$DIR/log/$name.log") $(tail_of "$DIR/log/$name.out" 3)"
    for _ in $(seq 50); do alive "$name" && return; sleep 0.1; done
    die "$name exited at start: $(tail_of "$DIR/log/$name.log") $(tail_of "$DIR/log/$name.out" 3)"
}
start slurmctld slurmctld -f "$CONF" -c  # -c: no jobs from an earlier start
start slurmd slurmd -f "$CONF"
state=""
for _ in $(seq 300); do
    state="$(node_state)"
    [[ "$state" == idle* ]] && break
    for name in slurmctld slurmd; do
        alive "$name" || die "$name died: $(tail_of "$DIR/log/$name.log")"
    done
    sleep 0.2
done
[[ "$state" == idle* ]] || die "node $HOST is ${state:-not listed}, not idle, 60 s after the start:" \
    "slurmctld: $(tail_of "$DIR/log/slurmctld.log" 4) slurmd: $(tail_of "$DIR/log/slurmd.log" 4)"
note "munged, slurmctld and slurmd up in $((SECONDS - t0)) s: node $HOST idle with $CPUS CPUs ($CONF)"
printf 'SLURM_CONF=%s\nstarted\n' "$CONF"
