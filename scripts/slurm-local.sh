#!/usr/bin/env bash
# A real single-node SLURM on this machine, for testing the workflow's SLURM profile
# (profiles/slurm/) through snakemake-executor-plugin-slurm. Debian's packages, no systemd.
#
#   sudo scripts/slurm-local.sh up      # install (first time), configure, start; waits until idle
#   sudo scripts/slurm-local.sh down    # stop the daemons this script started
#   scripts/slurm-local.sh status       # exit 0 when the controller answers and the node takes jobs
#
# `up` and `down` are idempotent. The node is this machine: its cores and memory (as
# `slurmd -C` reports them), one partition `membench` (the default), memory enforced per
# job by cgroups where the kernel offers them (a job over its --mem is killed:
# OUT_OF_MEMORY). No accounting database: the plugin reads job states with squeue, which
# keeps finished jobs for MinJobAge (set here to 10 minutes).
#
# It writes /etc/slurm/slurm.conf and /etc/slurm/cgroup.conf, marked as its own; a
# slurm.conf it did not write is never touched (the script stops: this is someone's
# real cluster). Daemons run as root; logs in /var/log/slurm/, state in /var/lib/slurm/.
set -euo pipefail

MARK="# written by membench scripts/slurm-local.sh"
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
CGROUP_CONF=$CONF_DIR/cgroup.conf
LOG_DIR=/var/log/slurm
STATE_DIR=/var/lib/slurm
PARTITION=membench
PACKAGES=(slurmctld slurmd slurm-client munge)
MUNGE_PID=/run/munge/munged.pid

say() { echo "slurm-local: $*" >&2; }
die() { say "$*"; exit 1; }

need_root() { [[ $(id -u) == 0 ]] || die "$1 needs root (it installs packages and starts daemons)"; }

installed() {
    local p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 1
    done
}

install_packages() {
    installed && return 0
    command -v apt-get >/dev/null || die "no apt-get: install ${PACKAGES[*]} by hand"
    say "installing ${PACKAGES[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null || die "apt-get update failed (no network?)"
    # policy-rc.d: the packages' maintainer scripts must not start daemons themselves
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >$policy && chmod +x $policy && made_policy=1
    fi
    apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null ||
        { [[ $made_policy == 1 ]] && rm -f $policy; die "apt-get install failed"; }
    [[ $made_policy == 1 ]] && rm -f $policy
    return 0
}

write_if_changed() {  # path content -> 0 when it changed
    local path=$1 content=$2
    if [[ -e $path ]] && ! head -n1 "$path" | grep -qF "$MARK"; then
        die "$path exists and was not written by this script; not touching a real cluster's config"
    fi
    if [[ -e $path ]] && [[ "$(cat "$path")" == "$content" ]]; then
        return 1
    fi
    printf '%s\n' "$content" >"$path"
    return 0
}

cgroup_v1_memory() { [[ -d /sys/fs/cgroup/memory && -w /sys/fs/cgroup/memory ]]; }
cgroup_v2() { [[ $(stat -fc %T /sys/fs/cgroup 2>/dev/null) == cgroup2fs ]]; }

configure() {
    local host cpus mem
    host=$(hostname -s)
    # what slurmd sees: CPUs=2 Boards=1 ... RealMemory=24105
    read -r cpus mem < <(slurmd -C | head -n1 | sed -E 's/.*CPUs=([0-9]+).*RealMemory=([0-9]+).*/\1 \2/')
    [[ -n $cpus && -n $mem ]] || die "could not read this machine's cores and memory from slurmd -C"
    mkdir -p "$CONF_DIR" "$LOG_DIR" "$STATE_DIR/slurmctld" "$STATE_DIR/slurmd"

    local proctrack task gather gather_params="" cgroup_plugin=""
    if cgroup_v1_memory; then
        cgroup_plugin=cgroup/v1
    elif cgroup_v2; then
        # Slurm 22.05's cgroup/v2 asks systemd (dbus) for a scope; without systemd use v1
        # or no cgroups at all (below)
        command -v systemctl >/dev/null && systemctl is-system-running >/dev/null 2>&1 &&
            cgroup_plugin=cgroup/v2
    fi
    if [[ -n $cgroup_plugin ]]; then
        proctrack=proctrack/cgroup task=task/cgroup gather=jobacct_gather/cgroup
    else
        # no usable cgroups: processes tracked by parent id, memory polled and a job over
        # its request killed by slurmd (JobAcctGatherParams=OverMemoryKill)
        proctrack=proctrack/linuxproc task=task/none gather=jobacct_gather/linux
        gather_params="JobAcctGatherParams=OverMemoryKill"
    fi

    local conf
    conf="$MARK
# A single-node test cluster: this machine ($host, $cpus CPUs, $mem MB).
ClusterName=membench
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
ProctrackType=$proctrack
TaskPlugin=$task
JobAcctGatherType=$gather
JobAcctGatherFrequency=5
$gather_params
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# finished jobs stay visible to squeue this long (the plugin's status checks need >= 120 s)
MinJobAge=600
ReturnToService=2
# a job that names no memory gets 1 GB per CPU (not the whole node)
DefMemPerCPU=1024
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
    local changed=0
    write_if_changed "$CONF" "$conf" && changed=1
    if [[ -n $cgroup_plugin ]]; then
        write_if_changed "$CGROUP_CONF" "$MARK
CgroupPlugin=$cgroup_plugin
ConstrainCores=yes
ConstrainRAMSpace=yes
ConstrainSwapSpace=no" && changed=1
    elif [[ -e $CGROUP_CONF ]] && head -n1 "$CGROUP_CONF" | grep -qF "$MARK"; then
        rm -f "$CGROUP_CONF"; changed=1
    fi
    echo $changed
}

munge_up() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
ctld_up() { scontrol ping 2>/dev/null | grep -q "is UP"; }
node_state() { sinfo -h -N -o %T 2>/dev/null | head -n1; }
pid_alive() {  # a pid file whose process runs (a zombie, reaped by no one, does not count)
    [[ -s $1 ]] || return 1
    local state; state=$(ps -o stat= -p "$(cat "$1")" 2>/dev/null) || return 1
    [[ -n $state && $state != Z* ]]
}

start_munge() {
    munge_up && return 0
    [[ -s /etc/munge/munge.key ]] || { mungekey --create >/dev/null 2>&1 || 
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; }
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged
    local i
    for i in $(seq 20); do munge_up && return 0; sleep 0.5; done
    die "munged did not start (see /var/log/munge/munged.log)"
}

up() {
    need_root up
    install_packages
    local changed
    changed=$(configure)
    start_munge
    if ctld_up && [[ $changed == 1 ]]; then
        say "configuration changed: restarting the daemons"
        scontrol shutdown >/dev/null 2>&1 || true
        local i; for i in $(seq 40); do pid_alive /run/slurmctld.pid || pid_alive /run/slurmd.pid || break; sleep 0.5; done
    fi
    pid_alive /run/slurmctld.pid || slurmctld
    local i
    for i in $(seq 40); do ctld_up && break; sleep 0.5; done
    ctld_up || die "slurmctld does not answer (see $LOG_DIR/slurmctld.log)"
    pid_alive /run/slurmd.pid || slurmd
    local state=""
    for i in $(seq 60); do
        state=$(node_state)
        case $state in
            idle|mixed|allocated|completing) break ;;
            down*|drain*|fail*) scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true ;;
        esac
        sleep 0.5
    done
    case $state in
        idle|mixed|allocated|completing) ;;
        *) die "node is '$state', not taking jobs (see $LOG_DIR/slurmd.log, sinfo -R)" ;;
    esac
    say "up: $(sinfo -h -o '%P %D node(s) %c CPUs %m MB %T') ($(sinfo -V))"
}

down() {
    need_root down
    if ctld_up; then
        scontrol shutdown >/dev/null 2>&1 || true
    fi
    local pidfile i
    for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
        for i in $(seq 40); do pid_alive $pidfile || break; sleep 0.5; done
        if pid_alive $pidfile; then kill "$(cat $pidfile)" 2>/dev/null || true; fi
    done
    if pid_alive $MUNGE_PID; then
        kill "$(cat $MUNGE_PID)" 2>/dev/null || true
    fi
    say "down"
}

status() {
    command -v sinfo >/dev/null || { say "not installed (no sinfo)"; return 1; }
    ctld_up || { say "controller not answering"; return 1; }
    local state; state=$(node_state)
    say "controller up; node $(hostname -s) is '$state' ($(sinfo -V))"
    case $state in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac
}

case ${1:-} in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
