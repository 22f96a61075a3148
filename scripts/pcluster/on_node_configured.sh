#!/bin/bash
# ParallelCluster OnNodeConfigured custom action: configure this node with gpuforge's fleet
# playbook through ansible-pull, so nodes that autoscaling adds configure themselves.
#
# ParallelCluster runs it as root once the node is configured, with the Args of
# CustomActions.OnNodeConfigured (see docs/cluster-spec.md). Options:
#   --repo URL         git URL of the gpuforge repository (required; GPUFORGE_REPO)
#   --ref REF          branch, tag or commit to check out (default main; GPUFORGE_REF)
#   --playbook PATH    playbook inside the repository (default playbooks/fleet.yml)
#   --node-type TYPE   HeadNode or Compute (default: cfn_node_type from /etc/parallelcluster/cfnconfig)
#   --workdir DIR      where the checkout and the Ansible virtualenv live (default /opt/gpuforge)
#   --python PATH      Python used to build the virtualenv (default python3)
# Anything after "--", and unrecognised options such as "--tags configure", go to ansible-pull.
set -euo pipefail

repo="${GPUFORGE_REPO:-}"
ref="${GPUFORGE_REF:-main}"
playbook=playbooks/fleet.yml
node_type=""
workdir=/opt/gpuforge
python=python3
pull_args=()

die() {
    echo "on_node_configured: $*" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case "$1" in
        --repo) repo="${2:?--repo needs a URL}"; shift 2 ;;
        --ref) ref="${2:?--ref needs a value}"; shift 2 ;;
        --playbook) playbook="${2:?--playbook needs a path}"; shift 2 ;;
        --node-type) node_type="${2:?--node-type needs HeadNode or Compute}"; shift 2 ;;
        --workdir) workdir="${2:?--workdir needs a directory}"; shift 2 ;;
        --python) python="${2:?--python needs a path}"; shift 2 ;;
        --) shift; pull_args+=("$@"); break ;;
        *) pull_args+=("$1"); shift ;;
    esac
done

[ -n "$repo" ] || die "no repository: pass --repo URL or set GPUFORGE_REPO"
[ "$(id -u)" -eq 0 ] || die "run as root (ParallelCluster runs custom actions as root)"

# ParallelCluster records the node's part in cfnconfig; ComputeFleet is a compute node.
if [ -z "$node_type" ] && [ -r /etc/parallelcluster/cfnconfig ]; then
    node_type="$(sed -n 's/^cfn_node_type=//p' /etc/parallelcluster/cfnconfig | tr -d '"' | head -n1)"
fi
case "$node_type" in
    HeadNode) group=head_node ;;
    Compute | ComputeFleet) node_type=Compute; group=compute ;;
    *) die "unknown node type '${node_type}': pass --node-type HeadNode or Compute" ;;
esac

log() { echo "on_node_configured: $*"; }

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" > /dev/null \
        || { apt-get update -q > /dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" > /dev/null; }
}

if ! command -v git > /dev/null; then
    log "installing git"
    apt_install git
fi

src="$workdir/src"
venv="$workdir/ansible"
mkdir -p "$workdir"
# The checkout comes first: it pins the Ansible version (requirements/constraints.txt).
if [ -d "$src/.git" ]; then
    git -C "$src" fetch --quiet --depth 1 origin "$ref"
    git -C "$src" checkout --quiet --force FETCH_HEAD
else
    git clone --quiet --depth 1 --branch "$ref" "$repo" "$src" 2> /dev/null \
        || { rm -rf "$src"; git clone --quiet "$repo" "$src" && git -C "$src" checkout --quiet "$ref"; }
fi

core_pin="$(grep -i '^ansible-core==' "$src/requirements/constraints.txt" || true)"
[ -n "$core_pin" ] || die "requirements/constraints.txt in $repo pins no ansible-core"
if ! "$venv/bin/ansible-pull" --version 2> /dev/null | grep -q "core ${core_pin#*==}"; then
    log "installing ${core_pin} into $venv"
    if ! "$python" -m venv "$venv" > /dev/null 2>&1; then
        # Debian and Ubuntu ship venv support separately.
        log "installing python3-venv"
        rm -rf "$venv"
        apt_install python3-venv
        "$python" -m venv "$venv"
    fi
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        -c "$src/requirements/constraints.txt" "$core_pin"
fi

# The node is its own inventory, in the groups the aws_ec2 inventory would put it in.
inventory="$workdir/inventory.ini"
cat > "$inventory.tmp" << INI
[$group]
localhost ansible_connection=local ansible_python_interpreter=/usr/bin/python3

[node_type_$node_type:children]
$group
INI
mv "$inventory.tmp" "$inventory"

log "ansible-pull $repo@$ref $playbook as $node_type"
cd "$src"
exec "$venv/bin/ansible-pull" --url "$repo" --checkout "$ref" --directory "$src" \
    --inventory "$inventory" --limit localhost "${pull_args[@]}" "$playbook"
