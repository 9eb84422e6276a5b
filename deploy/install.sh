#!/usr/bin/env bash
# Install (or upgrade, roll back, uninstall) edgeq on this box from an unpacked `edgeq bundle`.
#
#   sudo ./install.sh                  install or upgrade; idempotent: a second run changes nothing
#   sudo ./install.sh --with-gateway   ... and enable edgeq-gateway.service (the OpenAI-compatible
#                                      HTTP API); remembered: later runs keep it enabled
#   sudo ./install.sh --without-gateway          ... and disable it again
#   sudo ./install.sh --rollback       switch back to the previous release
#   sudo ./install.sh --uninstall      remove edgeq, keep /etc/edgeq and /var/lib/edgeq
#   sudo ./install.sh --uninstall --purge        ... and those too, and the user
#   ./install.sh --root DIR --no-systemd         stage into DIR (image builds, tests)
#   ./install.sh --check               only check this box against the bundle, install nothing
#
# Before it installs anything, it checks the box against the bundle's manifest.json: Python's
# version, and for a GPU bundle nvidia-smi and the NVIDIA driver its CUDA runtime needs, and
# free disk for the release and the model. A box that does not fit is refused with one line
# (what it has, what it needs, what to do) and exit status 78; nothing is installed.
#
# Layout: /opt/edgeq/releases/<version> (a venv each), /opt/edgeq/current -> the live one,
# /opt/edgeq/previous -> the one before (rollback); /etc/edgeq/edgeq.env (the operator's: never
# overwritten); /etc/edgeq/edgeq-<instance>.env (per worker instance: with several, each gets its
# own EDGEQ_METRICS_PORT unless set there); /var/lib/edgeq/models/<name>; units in
# /etc/systemd/system.
#
# Environment knobs: EDGEQ_PYTHON (default python3, must match the bundle's Python),
# EDGEQ_READY_TIMEOUT_S (wait for READY=1, default 1200), EDGEQ_GATEWAY_READY_TIMEOUT_S (wait
# for the gateway's GET /ready, default 120), EDGEQ_PIP_NO_COMPILE=1 (skip .pyc),
# EDGEQ_INSTALL_SMOKE_CMD (with --no-systemd only: replaces the smoke test; for tests).
set -eu

ROOT=""
USE_SYSTEMD=1
ACTION=install
PURGE=0
SMOKE=1
GATEWAY=""  # 1 --with-gateway, 0 --without-gateway, empty: keep it as it is
while [ $# -gt 0 ]; do
    case "$1" in
        --root) ROOT=${2:?--root needs a directory}; shift ;;
        --root=*) ROOT=${1#--root=} ;;
        --no-systemd) USE_SYSTEMD=0 ;;
        --no-smoke-test) SMOKE=0 ;;
        --uninstall) ACTION=uninstall ;;
        --purge) PURGE=1 ;;
        --rollback) ACTION=rollback ;;
        --with-gateway) GATEWAY=1 ;;
        --without-gateway) GATEWAY=0 ;;
        --check) ACTION=check ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ -n "$ROOT" ]; then
    mkdir -p "$ROOT"
    ROOT=$(cd "$ROOT" && pwd)
fi

HERE=$(cd "$(dirname "$0")" && pwd)
OPT=$ROOT/opt/edgeq
ETC=$ROOT/etc/edgeq
STATE=$ROOT/var/lib/edgeq
CACHE=$ROOT/var/cache/edgeq
UNITDIR=$ROOT/etc/systemd/system
SYSUSERS=$ROOT/usr/lib/sysusers.d/edgeq.conf
PYTHON=${EDGEQ_PYTHON:-python3}
READY_TIMEOUT_S=${EDGEQ_READY_TIMEOUT_S:-1200}
GATEWAY_READY_TIMEOUT_S=${EDGEQ_GATEWAY_READY_TIMEOUT_S:-120}
GATEWAY_UNIT=edgeq-gateway.service
CHANGED=0

say() { echo "edgeq install: $*"; }
changed() { CHANGED=$((CHANGED + 1)); echo "  + $*"; }
die() { echo "edgeq install: $*" >&2; exit 1; }
# sysexits' EX_CONFIG, as edgeq's own commands use it: this box does not fit this bundle.
EXIT_BOX_MISMATCH=78
refuse() { echo "edgeq install: refused: $*" >&2; exit "$EXIT_BOX_MISMATCH"; }

# Point LINK at TARGET (enable a unit) unless it already does; say so with MESSAGE.
enable_link() {
    if [ "$(readlink "$2" 2>/dev/null || true)" != "$1" ]; then
        ln -sfn "$1" "$2"
        changed "$3"
    fi
}

# Stop and disable UNIT (when systemd runs) and remove its wants LINK; say so with MESSAGE.
disable_unit() {
    if systemd_live; then systemctl disable --now "$1" >/dev/null 2>&1 || true; fi
    rm -f "$2"
    changed "$3"
}

# The number in the last `KEY=N` line of FILE, indented or quoted as a shell allows; else nothing.
env_int() {
    sed -n "s/^[[:space:]]*$1=[\"']\{0,1\}\([0-9]*\).*/\1/p" "$2" | tail -n 1
}

# systemctl only when asked for and systemd really runs this box (the check Ollama's installer
# makes: containers, chroots and WSL without systemd get the files, not the service calls).
systemd_live() {
    [ "$USE_SYSTEMD" = 1 ] || return 1
    command -v systemctl >/dev/null || return 1
    case "$(systemctl is-system-running 2>/dev/null || true)" in
        running|degraded|starting) return 0 ;;
        *) return 1 ;;
    esac
}

enabled_instances() {
    local wants=$UNITDIR/edgeq.target.wants
    [ -d "$wants" ] || return 0
    for link in "$wants"/edgeq-worker@*.service; do
        [ -e "$link" ] || [ -L "$link" ] || continue
        basename "$link"
    done
}

gateway_enabled() { [ -L "$UNITDIR/edgeq.target.wants/$GATEWAY_UNIT" ]; }

enabled_units() {  # the worker instances, and the gateway when it is enabled
    enabled_instances
    if gateway_enabled; then echo "$GATEWAY_UNIT"; fi
}

switch_current() {  # switch_current RELEASE-NAME: atomic, by rename(2) of a new symlink
    ln -sfn "releases/$1" "$OPT/current.new"
    mv -T "$OPT/current.new" "$OPT/current"
}

restart_services() {  # the workers and the gateway run from current: restart after a switch
    systemd_live || return 0
    local units
    units=$(enabled_units)
    [ -n "$units" ] || return 0
    # --no-block: a notify unit's start waits for READY=1, which can take minutes.
    # shellcheck disable=SC2086
    systemctl restart --no-block $units
}

# --- rollback ----------------------------------------------------------------------------------
if [ "$ACTION" = rollback ]; then
    [ -L "$OPT/previous" ] || die "no previous release to roll back to"
    prev=$(basename "$(readlink "$OPT/previous")")
    cur=$(basename "$(readlink "$OPT/current")")
    [ -d "$OPT/releases/$prev" ] || die "the previous release $prev is gone"
    switch_current "$prev"
    ln -sfn "releases/$cur" "$OPT/previous"
    restart_services
    say "rolled back from $cur to $prev"
    exit 0
fi

# --- uninstall ---------------------------------------------------------------------------------
if [ "$ACTION" = uninstall ]; then
    units=$(enabled_units)
    if systemd_live; then
        # shellcheck disable=SC2086
        systemctl disable --now edgeq.target $units >/dev/null 2>&1 || true
    fi
    rm -rf "$UNITDIR/edgeq.target.wants" "$UNITDIR/edgeq-worker@.service" \
        "$UNITDIR/edgeq-gateway.service" "$UNITDIR/edgeq.target" \
        "$UNITDIR/multi-user.target.wants/edgeq.target"
    systemd_live && systemctl daemon-reload
    rm -rf "$OPT" "$CACHE"
    if [ -f "$ROOT/etc/redis/redis.conf" ] && [ "$PURGE" = 1 ]; then
        sed -i '\#^include /etc/redis/redis-edgeq.conf$#d' "$ROOT/etc/redis/redis.conf"
        rm -f "$ROOT/etc/redis/redis-edgeq.conf"
        systemd_live && systemctl restart redis-server.service || true
    fi
    if [ "$PURGE" = 1 ]; then
        rm -rf "$ETC" "$STATE" "$SYSUSERS"
        if [ -z "$ROOT" ] && getent passwd edgeq >/dev/null; then userdel edgeq || true; fi
        say "removed edgeq, its settings (/etc/edgeq), models and data (/var/lib/edgeq)"
    else
        rm -f "$SYSUSERS"
        say "removed edgeq; kept ${ETC#"$ROOT"} and ${STATE#"$ROOT"} (--purge removes them)"
    fi
    exit 0
fi

# --- install / upgrade -------------------------------------------------------------------------
[ -f "$HERE/manifest.json" ] || die "run this from an unpacked edgeq bundle (no manifest.json in $HERE)"
WANT_PY=$(sed -n 's/^ *"python": "\([0-9.]*\)",*$/\1/p' "$HERE/manifest.json" | head -n 1)
command -v "$PYTHON" >/dev/null \
    || refuse "$PYTHON is not on this box; this bundle needs Python ${WANT_PY:-3}: install python$WANT_PY (with its venv module), or name one with EDGEQ_PYTHON"
manifest() {  # manifest KEY[.KEY]: one field of manifest.json; empty when absent or null
    "$PYTHON" -c 'import json, sys
value = json.load(open(sys.argv[1]))
for key in sys.argv[2].split("."):
    value = value.get(key) if isinstance(value, dict) else None
print("" if value is None else value)' "$HERE/manifest.json" "$1"
}
VERSION=$(manifest edgeq_version)
VARIANT=$(manifest variant)
MODEL=$(manifest model.name)
BUNDLE_ID=$(sha256sum "$HERE/manifest.json" | cut -d' ' -f1)
RELEASE=$OPT/releases/$VERSION
MODEL_DIR=$STATE/models/$MODEL

# --- the box against the bundle, before anything is installed ---------------------------------
version_at_least() {  # version_at_least HAVE WANT: dotted versions, numerically
    [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" = "$2" ]
}
nearest_dir() {  # the directory itself, or its nearest ancestor that exists
    local dir=$1
    while [ ! -d "$dir" ]; do dir=$(dirname "$dir"); done
    echo "$dir"
}
gb() { awk -v b="$1" 'BEGIN { printf "%.1f GB", b / 1e9 }'; }

check_python() {
    local have
    have=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$have" = "$WANT_PY" ] \
        || refuse "this box's $PYTHON is Python $have; this bundle is for Python $WANT_PY: install python$WANT_PY and set EDGEQ_PYTHON=python$WANT_PY, or build the bundle with Python $have"
}

check_driver() {  # a bundle whose manifest names a CUDA runtime: nvidia-smi, and its driver
    local min runtime have
    min=$(manifest cuda.min_driver)
    [ -n "$min" ] || return 0
    runtime=$(manifest cuda.runtime)
    command -v nvidia-smi >/dev/null \
        || refuse "no nvidia-smi on this box; this bundle's CUDA $runtime needs an NVIDIA GPU with driver $min or newer: install the NVIDIA driver ($min or newer), or build a CPU bundle (edgeq bundle --variant cpu)"
    have=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -n 1) || true
    have=$(echo "$have" | sed 's/^[[:space:]]*//; s/[[:space:]]*$//')
    [[ "$have" =~ ^[0-9]+(\.[0-9]+)*$ ]] \
        || refuse "nvidia-smi gives no driver version (it says: ${have:-nothing}); this bundle's CUDA $runtime needs NVIDIA driver $min or newer: check that the driver is loaded (nvidia-smi must list the GPUs)"
    version_at_least "$have" "$min" \
        || refuse "this box's NVIDIA driver is $have; this bundle's CUDA $runtime needs driver $min or newer: update the driver to $min or newer, or build the bundle with a torch for an older CUDA (docs/install.md)"
    DRIVER_SEEN="NVIDIA driver $have >= $min (CUDA $runtime)"
}

check_disk() {  # free space where the release and the model land (the same disk: their sum)
    local release_bytes model_bytes release_at model_at what="the release"
    release_bytes=$(manifest disk.release_bytes)
    model_bytes=$(manifest disk.model_bytes)
    [ -n "$release_bytes" ] || return 0
    # What is already there from this very bundle is not written again.
    if [ "$(cat "$RELEASE/.edgeq-bundle" 2>/dev/null || true)" = "$BUNDLE_ID" ]; then
        release_bytes=0
    fi
    if cmp -s "$HERE/models/$MODEL/SHA256SUMS" "$MODEL_DIR/SHA256SUMS"; then model_bytes=0; fi
    release_at=$(nearest_dir "$RELEASE")
    model_at=$(nearest_dir "$MODEL_DIR")
    if [ "$(stat -c %d "$release_at")" = "$(stat -c %d "$model_at")" ]; then
        release_bytes=$((release_bytes + model_bytes))
        model_bytes=0
        what="the release and its model"
    fi
    need_free "$release_at" "$release_bytes" "$what"
    need_free "$model_at" "$model_bytes" "the model"
}

need_free() {  # need_free DIR BYTES WHAT
    local free
    [ "$2" -gt 0 ] || return 0
    free=$(( $(df -Pk "$1" | awk 'NR == 2 { print $4 }') * 1024 ))
    [ "$free" -ge "$2" ] \
        || refuse "$1 has $(gb "$free") free; $3 of edgeq $VERSION needs $(gb "$2") there: free some space on that disk, or install onto another one"
}

DRIVER_SEEN=""
check_python
check_driver
check_disk
if [ "$ACTION" = check ]; then
    say "this box fits edgeq $VERSION ($VARIANT): Python $WANT_PY${DRIVER_SEEN:+, $DRIVER_SEEN}, disk enough; nothing installed (--check)"
    exit 0
fi
say "edgeq $VERSION ($VARIANT), model $MODEL, into ${ROOT:-/}"

# 1. The model must match its sums before anything is touched.
say "checking the model against SHA256SUMS"
if ! bad=$(cd "$HERE/models/$MODEL" && sha256sum -c --quiet SHA256SUMS 2>&1); then
    file=$(printf '%s\n' "$bad" | sed -n 's/^\(.*\): FAILED.*$/\1/p' | head -n 1)
    die "model file models/$MODEL/${file:-?} does not match SHA256SUMS: refusing to install (the bundle is damaged or was altered; copy it again)"
fi

# 2. The user, from a sysusers.d file (also what a first boot of an image creates).
mkdir -p "$(dirname "$SYSUSERS")"
if ! cmp -s "$HERE/deploy/edgeq.sysusers" "$SYSUSERS"; then
    install -m 0644 "$HERE/deploy/edgeq.sysusers" "$SYSUSERS"
    changed "sysusers.d entry for the edgeq user"
fi
OWNER=""
if [ -z "$ROOT" ]; then
    if ! getent passwd edgeq >/dev/null; then
        if command -v systemd-sysusers >/dev/null; then
            systemd-sysusers "$SYSUSERS"
        else
            useradd --system --user-group --home-dir /var/lib/edgeq --no-create-home \
                --shell /usr/sbin/nologin edgeq
        fi
        changed "system user edgeq"
    fi
    OWNER=edgeq
fi

# 3. The release: a venv with exactly the bundle's wheels (hash-checked by pip).
if [ "$(cat "$RELEASE/.edgeq-bundle" 2>/dev/null || true)" != "$BUNDLE_ID" ]; then
    say "installing release $VERSION (a venv from the wheelhouse)"
    rm -rf "$RELEASE"
    mkdir -p "$OPT/releases"
    "$PYTHON" -m venv "$RELEASE"
    compile=""
    [ "${EDGEQ_PIP_NO_COMPILE:-0}" = 1 ] && compile=--no-compile
    "$RELEASE/bin/python" -m pip install --quiet --disable-pip-version-check --no-index \
        --no-deps --require-hashes $compile --find-links "$HERE/wheelhouse" \
        -r "$HERE/wheelhouse/requirements.txt"
    if [ "$VARIANT" = cpu ]; then
        # Never in the wheelhouse; removed in case the box's pip pulled them some other way.
        "$RELEASE/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec \
            >/dev/null 2>&1 || true
    fi
    mkdir -p "$RELEASE/share/edgeq"
    cp -r "$HERE/systemd" "$HERE/manifest.json" "$HERE/README.md" "$RELEASE/share/edgeq/"
    echo "$BUNDLE_ID" >"$RELEASE/.edgeq-bundle"  # last: a half-made release is redone
    changed "release $VERSION in ${RELEASE#"$ROOT"}"
fi

# 4. The model, verified again where it lands.
if ! cmp -s "$HERE/models/$MODEL/SHA256SUMS" "$MODEL_DIR/SHA256SUMS" \
    || ! (cd "$MODEL_DIR" && sha256sum -c --quiet SHA256SUMS >/dev/null 2>&1); then
    mkdir -p "$STATE/models"
    rm -rf "$MODEL_DIR.new"
    cp -r "$HERE/models/$MODEL" "$MODEL_DIR.new"
    rm -rf "$MODEL_DIR"
    mv "$MODEL_DIR.new" "$MODEL_DIR"
    changed "model $MODEL in ${MODEL_DIR#"$ROOT"}"
fi
mkdir -p "$CACHE"
[ -n "$OWNER" ] && chown -R "$OWNER:$OWNER" "$STATE" "$CACHE"

# 5. Settings: the operator's file is never overwritten.
mkdir -p "$ETC"
ENV_FILE=$ETC/edgeq.env
if [ ! -f "$ENV_FILE" ]; then
    install -m 0640 "$HERE/edgeq.env" "$ENV_FILE"
    changed "settings ${ENV_FILE#"$ROOT"} (yours from now on: upgrades keep it)"
    FRESH_ENV=1
else
    FRESH_ENV=0
    want="EDGEQ_MODEL=$(manifest model.install_path)"
    grep -qx "$want" "$ENV_FILE" \
        || say "note: ${ENV_FILE#"$ROOT"} is kept as it is; this bundle's model is at ${want#EDGEQ_MODEL=}"
fi

# Redis: the snippet with a fresh password, hooked into the distribution's redis.conf if there.
REDIS_SNIPPET=$ETC/redis-edgeq.conf
if [ ! -f "$REDIS_SNIPPET" ]; then
    password=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
    sed "s/@EDGEQ_REDIS_PASSWORD@/$password/" "$HERE/deploy/redis-edgeq.conf" >"$REDIS_SNIPPET.new"
    chmod 0640 "$REDIS_SNIPPET.new"
    mv "$REDIS_SNIPPET.new" "$REDIS_SNIPPET"
    if [ "$FRESH_ENV" = 1 ]; then
        printf '\n# Written by install.sh: the password of deploy/redis-edgeq.conf.\nEDGEQ_REDIS_URL=redis://:%s@127.0.0.1:6379/0\n' \
            "$password" >>"$ENV_FILE"
    fi
    changed "Redis settings ${REDIS_SNIPPET#"$ROOT"} (loopback, password, noeviction, appendonly)"
fi
if [ -f "$ROOT/etc/redis/redis.conf" ] && ! grep -qx 'include /etc/redis/redis-edgeq.conf' "$ROOT/etc/redis/redis.conf"; then
    install -m 0640 "$REDIS_SNIPPET" "$ROOT/etc/redis/redis-edgeq.conf"
    getent group redis >/dev/null && [ -z "$ROOT" ] && chgrp redis "$ROOT/etc/redis/redis-edgeq.conf"
    echo 'include /etc/redis/redis-edgeq.conf' >>"$ROOT/etc/redis/redis.conf"
    systemd_live && systemctl restart redis-server.service
    changed "included redis-edgeq.conf in /etc/redis/redis.conf"
fi
[ -n "$OWNER" ] && chgrp "$OWNER" "$ENV_FILE"

# 6. Units, and which instances: one per GPU (nvidia-smi -L), or one spanning
#    EDGEQ_TENSOR_PARALLEL_SIZE GPUs each, or edgeq-worker@cpu without a GPU.
mkdir -p "$UNITDIR/edgeq.target.wants" "$UNITDIR/multi-user.target.wants"
UNITS_CHANGED=0
for unit in "$HERE"/systemd/*; do
    if ! cmp -s "$unit" "$UNITDIR/$(basename "$unit")"; then
        install -m 0644 "$unit" "$UNITDIR/$(basename "$unit")"
        changed "unit $(basename "$unit")"
        UNITS_CHANGED=1
    fi
done
gpus=0
if command -v nvidia-smi >/dev/null; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
tp=$(env_int EDGEQ_TENSOR_PARALLEL_SIZE "$ENV_FILE")
tp=${tp:-1}
[ "$tp" -ge 1 ] || tp=1
instances=""
if [ "$gpus" -gt 0 ]; then
    i=0
    while [ $((i + tp)) -le "$gpus" ]; do
        devices=$i
        j=1
        while [ "$j" -lt "$tp" ]; do devices="$devices\\x2c$((i + j))"; j=$((j + 1)); done
        instances="$instances edgeq-worker@$devices.service"
        i=$((i + tp))
    done
    say "nvidia-smi sees $gpus GPU(s), tensor parallel $tp:$instances"
    [ "$i" -eq "$gpus" ] || say "warning: $((gpus - i)) GPU(s) left unused (not a multiple of $tp)"
else
    [ "$VARIANT" = cpu ] || say "warning: no GPU seen by nvidia-smi; enabling the CPU instance of a GPU build"
    instances=" edgeq-worker@cpu.service"
    say "no GPU seen: one CPU worker, edgeq-worker@cpu"
fi
for enabled in $(enabled_instances); do
    case " $instances " in
        *" $enabled "*) ;;
        *)
            disable_unit "$enabled" "$UNITDIR/edgeq.target.wants/$enabled" \
                "disabled $enabled (not one of this box's instances now)"
            ;;
    esac
done
for instance in $instances; do
    enable_link /etc/systemd/system/edgeq-worker@.service \
        "$UNITDIR/edgeq.target.wants/$instance" "enabled $instance"
done
# Several instances on one box: each its own metrics port, EDGEQ_METRICS_PORT of edgeq.env
# (9400 by default) plus its position, in its own settings file (edgeq-%I.env, %I = "0" or
# "0,1"); a port the operator set there is kept. A worker exits (78) when its port is taken.
count=0
for instance in $instances; do count=$((count + 1)); done
if [ "$count" -gt 1 ]; then
    base=$(env_int EDGEQ_METRICS_PORT "$ENV_FILE")
    base=${base:-9400}
    if [ "$base" = 0 ]; then
        say "EDGEQ_METRICS_PORT=0 in ${ENV_FILE#"$ROOT"}: metrics off, no per-instance ports"
    else
        k=0
        for instance in $instances; do
            devices=${instance#edgeq-worker@}
            devices=${devices%.service}
            file=$ETC/edgeq-${devices//\\x2c/,}.env
            position=$k
            k=$((k + 1))
            if [ -f "$file" ] && grep -q '^[[:space:]]*EDGEQ_METRICS_PORT=' "$file"; then
                continue  # the operator's (or an earlier run's) choice
            fi
            port=$((base + position))
            if [ -s "$file" ] && [ -n "$(tail -c 1 "$file")" ]; then echo >>"$file"; fi
            [ -f "$file" ] || install -m 0640 /dev/null "$file"
            printf '# Written by install.sh: %s serves its metrics here (edgeq.env port + %d).\nEDGEQ_METRICS_PORT=%d\n' \
                "$instance" "$position" "$port" >>"$file"
            [ -n "$OWNER" ] && chgrp "$OWNER" "$file"
            changed "EDGEQ_METRICS_PORT=$port for $instance in ${file#"$ROOT"}"
        done
    fi
fi

# The gateway: enabled only when asked for (--with-gateway), then kept enabled by later runs.
GATEWAY_LINK=$UNITDIR/edgeq.target.wants/$GATEWAY_UNIT
if [ "$GATEWAY" = 1 ]; then
    enable_link "/etc/systemd/system/$GATEWAY_UNIT" "$GATEWAY_LINK" \
        "enabled $GATEWAY_UNIT (the OpenAI-compatible HTTP API; --without-gateway disables it)"
elif [ "$GATEWAY" = 0 ] && { [ -e "$GATEWAY_LINK" ] || [ -L "$GATEWAY_LINK" ]; }; then
    disable_unit "$GATEWAY_UNIT" "$GATEWAY_LINK" "disabled $GATEWAY_UNIT"
fi
enable_link /etc/systemd/system/edgeq.target "$UNITDIR/multi-user.target.wants/edgeq.target" \
    "enabled edgeq.target (starts at boot)"

# 7. Switch current, keeping the one before as previous; drop older releases.
current=$(basename "$(readlink "$OPT/current" 2>/dev/null || echo none)")
old_previous=$(readlink "$OPT/previous" 2>/dev/null || true)
SWITCHED=0
if [ "$current" != "$VERSION" ]; then
    switch_current "$VERSION"
    if [ "$current" != none ]; then
        ln -sfn "releases/$current" "$OPT/previous"
        changed "current -> $VERSION (previous: $current, kept for --rollback)"
    else
        changed "current -> $VERSION"
    fi
    SWITCHED=1
fi
previous=$(basename "$(readlink "$OPT/previous" 2>/dev/null || echo none)")

if [ "$CHANGED" = 0 ]; then
    say "edgeq $VERSION is already installed as bundled: nothing changed"
    exit 0
fi

# 8. Start (or restart) the workers, wait for READY=1, run one chat.
rollback() {
    reason=$1
    if [ "$SWITCHED" = 1 ] && [ "$previous" != none ] && [ -d "$OPT/releases/$previous" ]; then
        switch_current "$previous"
        if [ -n "$old_previous" ]; then ln -sfn "$old_previous" "$OPT/previous"; else rm -f "$OPT/previous"; fi
        restart_services
        die "smoke test failed: $reason. Rolled back to $previous; $VERSION stays in ${OPT#"$ROOT"}/releases for inspection (a new run retries it)."
    fi
    die "smoke test failed: $reason. No earlier release to roll back to."
}

# shellcheck disable=SC2317  # called through wait_until_ready
unit_active() {  # the worker units say READY=1 (Type=notify): systemd then calls them active
    [ "$(systemctl show -p ActiveState --value "$1")" = active ]
}

# UNIT TIMEOUT_S CHECK...: run CHECK every 2 s until it succeeds, leaving its output in $out;
# roll back if UNIT fails or TIMEOUT_S passes first.
wait_until_ready() {
    local unit=$1 timeout_s=$2 waited=0 state
    shift 2
    while ! out=$("$@" 2>&1); do
        state=$(systemctl show -p ActiveState --value "$unit")
        if [ "$state" = failed ] || [ "$waited" -ge "$timeout_s" ]; then
            journalctl -u "$unit" -n 30 --no-pager >&2 || true
            rollback "$unit is $state, not ready after ${waited} s${out:+: $out} (journalctl -u $unit)"
        fi
        sleep 2
        waited=$((waited + 2))
    done
}

# shellcheck disable=SC2317  # called through wait_until_ready
gateway_ready() {  # GET /ready of the gateway, where its settings make it listen
    # shellcheck disable=SC1090,SC1091
    (
        set -a
        . "$ENV_FILE"
        if [ -f "$ETC/edgeq-gateway.env" ]; then . "$ETC/edgeq-gateway.env"; fi
        set +a
        "$OPT/current/bin/python" -c 'import os, sys, urllib.error, urllib.request
host = os.environ.get("EDGEQ_GATEWAY_HOST") or "127.0.0.1"
host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
url = "http://%s:%s/ready" % ("[%s]" % host if ":" in host else host,
                             os.environ.get("EDGEQ_GATEWAY_PORT") or "8000")
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
try:
    with opener.open(url, timeout=5) as response:
        print(url, response.status, response.read().decode()[:200])
except urllib.error.HTTPError as error:  # 503 until a warm worker heartbeats
    sys.exit("%s %s %s" % (url, error.code, error.read().decode()[:200]))
except OSError as error:
    sys.exit("%s %s" % (url, error))'
    )
}

if systemd_live; then
    systemctl daemon-reload
    systemctl enable edgeq.target >/dev/null
    if [ "$SWITCHED" = 1 ] || [ "$UNITS_CHANGED" = 1 ]; then restart_services; fi
    systemctl start --no-block edgeq.target
    if [ "$SMOKE" = 1 ]; then
        for instance in $instances; do
            say "waiting for $instance to be ready (READY=1, up to ${READY_TIMEOUT_S} s)"
            wait_until_ready "$instance" "$READY_TIMEOUT_S" unit_active "$instance"
        done
        say "smoke test: one chat through the queue"
        # shellcheck disable=SC1090
        if ! out=$(set -a && . "$ENV_FILE" && set +a && "$OPT/current/bin/edgeq" chat \
            --max-tokens 8 --timeout 120 "Say hello." 2>&1); then
            rollback "edgeq chat: $out"
        fi
        say "smoke test passed: $out"
        if gateway_enabled; then
            say "waiting for $GATEWAY_UNIT to be ready (GET /ready, up to ${GATEWAY_READY_TIMEOUT_S} s)"
            wait_until_ready "$GATEWAY_UNIT" "$GATEWAY_READY_TIMEOUT_S" gateway_ready
            say "gateway ready: $out"
        fi
    fi
else
    [ "$USE_SYSTEMD" = 1 ] && say "systemd is not running here: units installed and enabled, not started"
    if [ "$SMOKE" = 1 ]; then
        if [ -n "${EDGEQ_INSTALL_SMOKE_CMD:-}" ]; then
            smoke=$EDGEQ_INSTALL_SMOKE_CMD
        else
            # Without systemd no worker runs: check that the release imports its engine.
            # -I: the working directory is not put first on the path (a source checkout
            # there would shadow the release's edgeq).
            smoke='"$EDGEQ_CURRENT/bin/python" -I -c "import vllm, edgeq.worker.engine, edgeq.worker.notify, edgeq.gateway.app" && "$EDGEQ_CURRENT/bin/edgeq" --help >/dev/null'
        fi
        say "smoke test (no systemd): $smoke"
        if ! out=$(EDGEQ_CURRENT=$OPT/current sh -c "$smoke" 2>&1); then
            rollback "$(printf '%s\n' "$out" | tail -n 5)"
        fi
        say "smoke test passed"
    fi
fi

# Only after a good start: drop releases other than current and previous.
for release in "$OPT"/releases/*; do
    name=$(basename "$release")
    [ "$name" = "$VERSION" ] || [ "$name" = "$previous" ] || [ ! -d "$release" ] && continue
    rm -rf "$release"
    echo "  - removed old release $name"
done
say "edgeq $VERSION installed ($CHANGED change(s)); previous release: $previous"
systemd_live && say "status: systemctl status 'edgeq-worker@*'   logs: journalctl -u 'edgeq-worker@*' -f"
systemd_live && gateway_enabled && say "gateway: systemctl status $GATEWAY_UNIT   logs: journalctl -u $GATEWAY_UNIT -f"
exit 0
