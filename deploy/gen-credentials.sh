#!/usr/bin/env bash
# Generate the NATS passwords of one PERSIA deployment, at deploy time: nothing secret is committed
# (deploy/credentials/ is in .gitignore and .dockerignore).
#
#   bash deploy/gen-credentials.sh [--force] [--job NAME] [DIR]
#
# writes, into DIR (default deploy/credentials, or $PERSIA_CREDENTIALS_DIR), mode 600:
#   nats.env            for the NATS servers, which compose's nodes read with env_file: every
#                       role's PERSIA_*_PASSWORD (nats-auth.conf reads them), PERSIA_ROUTE_PASSWORD
#                       (the cluster's route port, nats-cluster.conf) and compose's routes with it,
#                       PERSIA_NATS_ROUTE_1..3 (nats-route://route:<password>@nats1:6222, ...)
#   <role>.env          PERSIA_NATS_USER and PERSIA_NATS_PASSWORD of one role: ps, embedding-worker,
#                       nn-worker, data-loader (compose's env_file), publisher (external batch
#                       publishers), serving (`persia-launcher serve`), predict-client (clients of
#                       the inference servers) and admin (`persia-launcher status`, `checkpoint`)
#   secret.yml          the same as the Kubernetes Secret <job>-nats-credentials (keys: the password
#                       variables of nats.env; no route URLs: the NATS pods compose theirs from
#                       PERSIA_ROUTE_PASSWORD), for `kubectl apply -f` before deploy/k8s or the Helm chart
# --job sets the Secret's job (default adult, the example's). An existing DIR is kept unless
# --force: new passwords lock out a running deployment until its NATS servers restart. A DIR
# written by an older version gets what it lacks added (the route password, the passwords of users
# added since), every password it has kept.
set -euo pipefail

force=0
job=adult
dir=${PERSIA_CREDENTIALS_DIR:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --force) force=1 ;;
    --job) job=${2:?--job needs a name}; shift ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gen-credentials: unknown option $1" >&2; exit 2 ;;
    *) dir=$1 ;;
  esac
  shift
done
dir=${dir:-"$(dirname "$0")/credentials"}
if ! [[ $job =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]]; then
  echo "gen-credentials: --job $job: a Kubernetes name is lower-case letters, digits and '-'" >&2
  exit 2
fi
# letters and digits after a letter: nats-server reads the value as a string, never a number, and
# it can stand in a route URL's user:password@ as it is
new_password() { echo "pw-$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')"; }

# the route port's one user (nats-cluster.conf): a server that routes to a node without it is
# refused, so reaching port 6222 no longer means joining the cluster and reading every message.
# route_entries ENV SECRET appends the password and compose's route URLs to both files.
route_entries() {
  local route_password
  route_password=$(new_password)
  echo "PERSIA_ROUTE_PASSWORD=$route_password" >> "$1"
  for i in 1 2 3; do
    echo "PERSIA_NATS_ROUTE_$i=nats-route://route:$route_password@nats$i:6222" >> "$1"
  done
  # k8s composes its route URLs from this one key (deploy/k8s/nats.yml, the Helm chart)
  if [ -e "$2" ]; then
    echo "  PERSIA_ROUTE_PASSWORD: \"$route_password\"" >> "$2"
  fi
}

# user, then the server's variable for its password (nats-auth.conf)
roles=(ps:PERSIA_PS_PASSWORD embedding-worker:PERSIA_EW_PASSWORD nn-worker:PERSIA_NN_PASSWORD
       data-loader:PERSIA_LOADER_PASSWORD publisher:PERSIA_PUBLISHER_PASSWORD serving:PERSIA_SERVING_PASSWORD
       predict-client:PERSIA_PREDICT_PASSWORD admin:PERSIA_ADMIN_PASSWORD)

# role_entry USER VAR ENV SECRET DIR: a new password for USER, in the servers' ENV, the Secret (when
# there is one) and DIR/USER.env
role_entry() {
  local password
  password=$(new_password)
  echo "$2=$password" >> "$3"
  printf 'PERSIA_NATS_USER=%s\nPERSIA_NATS_PASSWORD=%s\n' "$1" "$password" > "$5/$1.env"
  if [ -e "$4" ]; then
    echo "  $2: \"$password\"" >> "$4"
  fi
}

if [ -e "$dir/nats.env" ] && [ $force -eq 0 ]; then
  # a folder of an older version: nats-auth.conf names every variable, and a server missing one
  # refuses to start, so what the folder lacks is added and what it has is kept
  umask 077
  added=()
  if ! grep -q '^PERSIA_ROUTE_PASSWORD=' "$dir/nats.env"; then
    route_entries "$dir/nats.env" "$dir/secret.yml"
    added+=("PERSIA_ROUTE_PASSWORD and PERSIA_NATS_ROUTE_1..3")
  fi
  for entry in "${roles[@]}"; do
    if ! grep -q "^${entry#*:}=" "$dir/nats.env"; then
      role_entry "${entry%%:*}" "${entry#*:}" "$dir/nats.env" "$dir/secret.yml" "$dir"
      added+=("${entry#*:} (${entry%%:*}.env)")
    fi
  done
  if [ ${#added[@]} -gt 0 ]; then
    echo "gen-credentials: $dir was written by an older version: added $(IFS=,; echo "${added[*]}" | sed 's/,/, /g')" \
         "(to secret.yml too), kept every other password; restart the NATS servers (on Kubernetes," \
         "kubectl apply -f secret.yml first)" >&2
    exit 0
  fi
  echo "gen-credentials: $dir/nats.env exists; keeping it (--force replaces every password)" >&2
  exit 0
fi

umask 077
mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.new.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
{
  echo "# NATS passwords of this deployment, generated $(date -u +%FT%TZ) by deploy/gen-credentials.sh"
} > "$tmp/nats.env"
{
  echo "# the Kubernetes Secret of job $job, generated by deploy/gen-credentials.sh; do not commit"
  echo "apiVersion: v1"
  echo "kind: Secret"
  echo "metadata:"
  echo "  name: $job-nats-credentials"
  echo "  labels:"
  echo "    app.kubernetes.io/name: persia"
  echo "    app.kubernetes.io/instance: $job"
  echo "type: Opaque"
  echo "stringData:"
} > "$tmp/secret.yml"
for entry in "${roles[@]}"; do
  role_entry "${entry%%:*}" "${entry#*:}" "$tmp/nats.env" "$tmp/secret.yml" "$tmp"
done
route_entries "$tmp/nats.env" "$tmp/secret.yml"
mv -f "$tmp"/* "$dir"/
echo "gen-credentials: wrote $dir/{nats,ps,embedding-worker,nn-worker,data-loader,publisher,serving,predict-client,admin}.env" \
     "and secret.yml" >&2
