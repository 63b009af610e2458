#!/usr/bin/env bash
# One multi-controller program on every worker of a Cloud TPU VM slice.
#
#   launch/tpu_pod.sh NAME ZONE [-g GENERATION_PROCESSES] [-d REPO_DIR] [-p PROJECT] -- \
#       python -m streamrl_jax.launch --config=configs/NAME.py
#
# Runs `gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all --command ...`:
# the same command on every worker, from REPO_DIR (default ~/streamrl_jax, a checkout
# with the package installed on each worker). Each worker gets:
#   STREAMRL_GENERATION_PROCESSES  workers 0..G-1 generate, the rest train (default 1)
#   STREAMRL_AUTHKEY               a fresh random key per run unless already exported
# STREAMRL_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID stay unset: on Cloud TPU
# `jax.distributed.initialize()` finds them from the TPU metadata. The key travels
# inside the ssh command, so other users of the workers could read it from `ps`
# while the command starts; on shared VMs put it in a 0600 file and export it from there.
set -euo pipefail
usage() {
  echo "usage: $0 NAME ZONE [-g N] [-d REPO_DIR] [-p PROJECT] -- COMMAND [ARGS...]" >&2
  exit 2
}
[ "$#" -ge 2 ] || usage
name=$1 zone=$2
shift 2
generation=${STREAMRL_GENERATION_PROCESSES:-1}
repo_dir='~/streamrl_jax'
project=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
  case $1 in
    -g) generation=$2; shift 2 ;;
    -d) repo_dir=$2; shift 2 ;;
    -p) project=(--project "$2"); shift 2 ;;
    *) usage ;;
  esac
done
[ "${1:-}" = "--" ] && [ "$#" -ge 2 ] || usage
shift
authkey=${STREAMRL_AUTHKEY:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}
command="cd $repo_dir && STREAMRL_GENERATION_PROCESSES=$generation STREAMRL_AUTHKEY=$authkey"
command+=" $(printf '%q ' "$@")"
exec gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" "${project[@]}" --worker=all \
  --command "$command"
