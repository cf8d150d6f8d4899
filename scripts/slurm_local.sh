#!/usr/bin/env bash
# A single-node SLURM cluster on localhost, for `pytest -m slurm` (tests/test_slurm.py).
#
#   bash scripts/slurm_local.sh up       install (apt) if needed, configure, start munged, slurmctld, slurmd
#   bash scripts/slurm_local.sh status   what runs, and sinfo
#   bash scripts/slurm_local.sh down     stop the three daemons (the config stays, `up` rewrites it)
#
# Debian/Ubuntu packages slurm-wlm and munge; needs root (or sudo). This host is controller and
# only compute node: CPUs = nproc, RealMemory from /proc/meminfo, GPUs (gres) only when
# nvidia-smi lists some. No accounting database: `sacct` does not answer, so the test queries
# job states with squeue (--slurm-status-command squeue) and MinJobAge keeps finished jobs
# visible for an hour. Cgroups are not used (proctrack/linuxproc, task/none): it runs in
# containers and sandboxes too, but does not confine a job to its CPUs or memory.
#
# Writes /etc/slurm/slurm.conf (and gres.conf) — the path the Debian binaries read — after
# saving a config it did not write as slurm.conf.orig. State and logs: $SLURM_LOCAL_DIR
# (default /var/lib/slurm-local).
set -euo pipefail

STATE=${SLURM_LOCAL_DIR:-/var/lib/slurm-local}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# written by wamrl scripts/slurm_local.sh"

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "slurm_local.sh: needs root or sudo" >&2; exit 1; }
  SUDO=sudo
fi

pid_of() {  # pid_of NAME: the pid in $STATE/NAME.pid when that process still runs
  local f=$STATE/$1.pid
  if [ -s "$f" ] && $SUDO kill -0 "$(cat "$f")" 2>/dev/null; then cat "$f"; fi
}

install_packages() {
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
  fi
}

write_config() {
  local host cpus mem_mb gres_line="" gpus=0
  host=$(hostname -s)
  cpus=$(nproc)
  # Leave 512 MiB to the OS and the daemons.
  mem_mb=$(awk '/^MemTotal:/ {m = int($2 / 1024) - 512; print (m > 512 ? m : 512)}' /proc/meminfo)
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L | grep -c '^GPU ' || true)
  fi
  $SUDO mkdir -p "$CONF_DIR" "$STATE/ctld" "$STATE/d" "$STATE/log"
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    $SUDO cp -n "$CONF" "$CONF.orig"
  fi
  if [ "$gpus" -gt 0 ]; then
    gres_line="Gres=gpu:$gpus"
    {
      echo "$MARK"
      echo "AutoDetect=off"
      for ((i = 0; i < gpus; i++)); do echo "NodeName=$host Name=gpu File=/dev/nvidia$i"; done
    } | $SUDO tee "$CONF_DIR/gres.conf" >/dev/null
  else
    $SUDO rm -f "$CONF_DIR/gres.conf"
  fi
  $SUDO tee "$CONF" >/dev/null <<EOF
$MARK
ClusterName=wamrl-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=3600
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MpiDefault=none
${gpus:+GresTypes=gpu}
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb $gres_line State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  if [ "$gpus" -eq 0 ]; then $SUDO sed -i '/^GresTypes=/d' "$CONF"; fi
}

start_munge() {
  if pgrep -x munged >/dev/null; then return; fi
  if [ ! -s /etc/munge/munge.key ]; then
    $SUDO mkdir -p /etc/munge
    $SUDO dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
  $SUDO chown munge:munge /etc/munge/munge.key
  $SUDO chmod 400 /etc/munge/munge.key
  $SUDO mkdir -p /run/munge /var/log/munge /var/lib/munge
  $SUDO chown munge:munge /run/munge /var/log/munge /var/lib/munge
  $SUDO runuser -u munge -- /usr/sbin/munged
}

wait_for_node() {
  for _ in $(seq 60); do
    if sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then return 0; fi
    sleep 1
  done
  echo "slurm_local.sh: the node did not come up; see $STATE/log/" >&2
  sinfo -N -l >&2 || true
  return 1
}

up() {
  install_packages
  write_config
  start_munge
  if [ -z "$(pid_of slurmctld)" ]; then
    # -i: ignore state saved by an earlier `up` whose config may differ.
    $SUDO /usr/sbin/slurmctld -i
  else
    $SUDO scontrol reconfigure
  fi
  if [ -z "$(pid_of slurmd)" ]; then $SUDO /usr/sbin/slurmd; fi
  wait_for_node
  # A node that was down with an earlier config stays down until resumed.
  $SUDO scontrol update NodeName="$(hostname -s)" State=RESUME 2>/dev/null || true
  sinfo
}

down() {
  local name pid
  for name in slurmd slurmctld; do
    pid=$(pid_of $name)
    if [ -n "$pid" ]; then
      $SUDO kill "$pid"
      for _ in $(seq 20); do $SUDO kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    fi
  done
  # munged: stopped only where this script started it (it wrote no pid file: ask munged itself).
  if pgrep -x munged >/dev/null && [ -f "$CONF" ] && grep -qF "$MARK" "$CONF"; then
    $SUDO runuser -u munge -- /usr/sbin/munged --stop 2>/dev/null || true
  fi
  echo "stopped"
}

status() {
  local name rc=0
  for name in slurmctld slurmd; do
    if [ -n "$(pid_of $name)" ]; then echo "$name: running (pid $(pid_of $name))"; else echo "$name: stopped"; rc=1; fi
  done
  if pgrep -x munged >/dev/null; then echo "munged: running"; else echo "munged: stopped"; rc=1; fi
  if [ $rc -eq 0 ]; then sinfo -N -l; fi
  return $rc
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
