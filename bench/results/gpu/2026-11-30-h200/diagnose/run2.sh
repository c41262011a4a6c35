cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:/tmp/kimi-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kimi-site .whl/*.whl >/dev/null 2>&1
for c in "8 1 32 bf16" "4 1 32 bf16" "8 2 32 bf16" "4 2 32 bf16" "8 1 64 bf16" "8 1 16 bf16" "4 1 64 bf16"; do
  timeout 40 python3 dbg/variants.py $c 2>&1 | grep -E "variant|Error|error" | head -2 | cut -c1-300 | sed "s/^/[$c] /"
done
timeout 60 compute-sanitizer --tool memcheck --print-limit 3 python3 dbg/variants.py 8 1 32 bf16 > $OUT/sanitizer.txt 2>&1
grep -v "Host Frame" $OUT/sanitizer.txt | head -30
