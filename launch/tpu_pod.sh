#!/usr/bin/env bash
# One multi-controller program on every worker of a Cloud TPU VM slice.
#
#   launch/tpu_pod.sh NAME ZONE [-g GENERATION_PROCESSES] [-s SCORING_PROCESSES] \
#       [-d REPO_DIR] [-p PROJECT] -- \
#       python -m streamrl_jax.launch --config=configs/NAME.py
#
# Runs `gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all --command ...`:
# the same command on every worker, from REPO_DIR (default ~/streamrl_jax, a checkout
# with the package installed on each worker). Each worker gets:
#   STREAMRL_GENERATION_PROCESSES  workers 0..G-1 generate, the rest train (default 1)
#   STREAMRL_SCORING_PROCESSES     the last S workers serve the run's judge (default 0)
#   STREAMRL_AUTHKEY_FILE          ~/.streamrl/run-<id>.key: a fresh random run secret
#                                  (or $STREAMRL_AUTHKEY if exported), copied by scp into
#                                  an owner-only directory on every worker, removed when
#                                  the run ends; never on a command line (`ps` shows those)
# STREAMRL_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID stay unset: on Cloud TPU
# `jax.distributed.initialize()` finds them from the TPU metadata.
set -euo pipefail
usage() {
  echo "usage: $0 NAME ZONE [-g N] [-s S] [-d REPO_DIR] [-p PROJECT] -- COMMAND [ARGS...]" >&2
  exit 2
}
[ "$#" -ge 2 ] || usage
name=$1 zone=$2
shift 2
generation=${STREAMRL_GENERATION_PROCESSES:-1}
scoring=${STREAMRL_SCORING_PROCESSES:-0}
repo_dir='~/streamrl_jax'
project=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
  case $1 in
    -g) generation=$2; shift 2 ;;
    -s) scoring=$2; shift 2 ;;
    -d) repo_dir=$2; shift 2 ;;
    -p) project=(--project "$2"); shift 2 ;;
    *) usage ;;
  esac
done
[ "${1:-}" = "--" ] && [ "$#" -ge 2 ] || usage
shift
keyfile=$(mktemp)  # mode 0600
trap 'rm -f "$keyfile"' EXIT
if [ -n "${STREAMRL_AUTHKEY:-}" ]; then
  printf '%s' "$STREAMRL_AUTHKEY" >"$keyfile"
else
  python3 -c 'import secrets; print(secrets.token_hex(32), end="")' >"$keyfile"
fi
remote_key=".streamrl/run-$(date +%s)-$$.key"
ssh_all() {
  gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" "${project[@]}" --worker=all "$@"
}
ssh_all --command "mkdir -p ~/.streamrl && chmod 700 ~/.streamrl"
gcloud compute tpus tpu-vm scp "$keyfile" "$name:$remote_key" --zone "$zone" "${project[@]}" \
  --worker=all
command="chmod 600 ~/$remote_key && cd $repo_dir && STREAMRL_GENERATION_PROCESSES=$generation"
command+=" STREAMRL_SCORING_PROCESSES=$scoring"
command+=" STREAMRL_AUTHKEY_FILE=~/$remote_key $(printf '%q ' "$@"); rc=\$?; rm -f ~/$remote_key;"
command+=" exit \$rc"
ssh_all --command "$command"
