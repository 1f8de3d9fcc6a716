import json
for part in ["gpt2","llama","mods","win64"]:
    b = json.load(open(f"./before_{part}.json")); a = json.load(open(f"./after_{part}.json"))
    for x, y in zip(b, a):
        assert x["key"] == y["key"]
        same = x["ptx"] == y["ptx"]
        f = lambda r: f'{r["shared"]}/{r["spill_bytes"]}/{r["loop_spills"]}/{r["wgmma"]}/{";".join(r["wgmma_notes"]) or "-"}'
        print(f'{part:5} {x["variant"]:40} {y["config"]:45} {"SASS-same" if same else "changed ":9} {f(x):24} -> {f(y)}')
