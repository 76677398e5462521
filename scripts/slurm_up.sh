#!/usr/bin/env bash
# Start a one-node SLURM on this machine (Debian/Ubuntu, root, no systemd needed) for tests
# and trying profiles/local-slurm:
#
#   scripts/slurm_up.sh STATE_DIR          # sinfo, sbatch, snakemake --executor slurm ...
#   scripts/slurm_down.sh STATE_DIR        # stops exactly the daemons this script started
#
# Everything it writes lives in STATE_DIR (config, spool, logs), except munge's key and socket
# (/run/draftsmith-slurm-<port>/, see below) and one symlink /etc/slurm/slurm.conf ->
# STATE_DIR/slurm.conf: commands inside a job (the executor plugin's srun) find the
# configuration only there, since the plugin drops SLURM_CONF from the job's environment.
# It refuses to replace a slurm.conf that is not such a symlink.
# Installs slurm-wlm's daemons and munge with apt-get when they are missing (apt-get update once).
# Environment:
#   FAKE_GPUS=N       advertise N fake GPUs (gres gpu, type "fake"; character devices that
#                     behave like /dev/null) so GPU requests schedule; adds partition "gpu"
#   SLURM_PORT=6817   slurmctld port (slurmd uses the next one)
# Partitions: "cpu" (default) and, with FAKE_GPUS > 0, "gpu", both on the one node.
set -euo pipefail
STATE="${1:?usage: slurm_up.sh STATE_DIR}"
FAKE_GPUS="${FAKE_GPUS:-0}"
PORT="${SLURM_PORT:-6817}"
mkdir -p "$STATE"
STATE="$(cd "$STATE" && pwd)"
PIDS="$STATE/pids"
if [ -s "$PIDS" ]; then
  echo "slurm_up: $PIDS lists running daemons; run scripts/slurm_down.sh $STATE first" >&2
  exit 1
fi

pkgs=(slurmctld slurmd slurm-client munge)
if ! dpkg -s "${pkgs[@]}" >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" \
    >"$STATE/apt.log"
fi

# munge: our own key, socket and pid file (the system's munged, if any, is left alone). munged
# wants every directory above its socket searchable by all, which a private STATE_DIR (mktemp,
# pytest) is not: its files live in /run/draftsmith-slurm-<port>/munge (removed by slurm_down.sh).
RUNDIR="/run/draftsmith-slurm-$PORT"
MUNGE="$RUNDIR/munge"
mkdir -p "$MUNGE"
echo "$RUNDIR" >"$STATE/rundir"
[ -s "$MUNGE/munge.key" ] || mungekey --create --keyfile="$MUNGE/munge.key"
chown -R munge:munge "$MUNGE"
chmod 0755 "$RUNDIR" "$MUNGE"
chmod 0600 "$MUNGE/munge.key"
SOCKET="$MUNGE/munge.socket"
runuser -u munge -- /usr/sbin/munged --key-file="$MUNGE/munge.key" \
  --socket="$SOCKET" --pid-file="$MUNGE/munged.pid" \
  --log-file="$MUNGE/munged.log" --seed-file="$MUNGE/munged.seed"
for _ in $(seq 50); do [ -s "$MUNGE/munged.pid" ] && break; sleep 0.1; done
echo "munged $(cat "$MUNGE/munged.pid")" >>"$PIDS"
munge --socket="$SOCKET" -n | unmunge --socket="$SOCKET" >/dev/null

NODE="$(hostname -s)"
CPUS="$(nproc)"
MEM_MB=$(($(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) - 1024))
rm -rf "$STATE/ctld" "$STATE/slurmd"
mkdir -p "$STATE/ctld" "$STATE/slurmd" "$STATE/log"
gres="" gres_types="" gpu_partition=""
if [ "$FAKE_GPUS" -gt 0 ]; then
  last=$((FAKE_GPUS - 1))
  for i in $(seq 0 "$last"); do
    [ -c "$STATE/fakegpu$i" ] || mknod "$STATE/fakegpu$i" c 1 3
  done
  echo "NodeName=$NODE Name=gpu Type=fake File=$STATE/fakegpu[0-$last]" >"$STATE/gres.conf"
  gres=" Gres=gpu:fake:$FAKE_GPUS"
  gres_types="GresTypes=gpu"
  gpu_partition="PartitionName=gpu Nodes=$NODE MaxTime=INFINITE State=UP"
fi
cat >"$STATE/slurm.conf" <<EOF
ClusterName=draftsmith
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=1800
$gres_types
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
Waittime=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB$gres State=UNKNOWN
PartitionName=cpu Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
$gpu_partition
EOF
export SLURM_CONF="$STATE/slurm.conf"
mkdir -p /etc/slurm
if [ -e /etc/slurm/slurm.conf ] && ! [ -L /etc/slurm/slurm.conf ]; then
  echo "slurm_up: /etc/slurm/slurm.conf exists and is not ours (a site SLURM?); not replacing" >&2
  exit 1
fi
ln -sfn "$SLURM_CONF" /etc/slurm/slurm.conf

# the daemons in the foreground (-D), each in its own session (setsid execs, so $! is the
# daemon's PID): they outlive this script and its caller's process group
setsid /usr/sbin/slurmctld -D -f "$SLURM_CONF" </dev/null >"$STATE/log/slurmctld.out" 2>&1 &
echo "slurmctld $!" >>"$PIDS"
setsid /usr/sbin/slurmd -D -f "$SLURM_CONF" </dev/null >"$STATE/log/slurmd.out" 2>&1 &
echo "slurmd $!" >>"$PIDS"
state=""
for _ in $(seq 150); do
  state="$(sinfo -h -N -o %T 2>/dev/null | head -1 || true)"
  case "$state" in
  idle*) break ;;
  *drain* | *down*) scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
  esac
  sleep 0.2
done
if [[ "$state" != idle* ]]; then
  echo "slurm_up: node $NODE is '$state' after 30 s; see $STATE/log/" >&2
  exit 1
fi
sinfo -N -o "%N %P %T %c %m %G"
echo "export SLURM_CONF=$SLURM_CONF"
