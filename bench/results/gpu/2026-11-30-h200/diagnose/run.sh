cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:/tmp/kimi-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kimi-site .whl/*.whl >/dev/null 2>&1
for c in "init bf16 same 4 100,1,199,137,63" "init bf16 fp32 4 100,1,199,137,63" "noinit bf16 fp32 4 256,256" "noinit bf16 same 4 256,256" "init fp16 same 4 100,1,199,137,63" "noinit bf16 fp32 32 4096"; do
  timeout 60 python3 dbg/kda_fault.py $c 2>&1 | grep -v "^  ok" | tail -8
done
timeout 150 compute-sanitizer --tool memcheck --print-limit 4 python3 dbg/kda_fault.py init bf16 same 4 100,1,199,137,63 2>&1 | tail -60
