from fusionllm.cli import run

run()
