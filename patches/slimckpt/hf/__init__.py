"""The Hugging Face side of an export, below both the offline merge and the in-training export:
`naming` (what save_pretrained names, drops and writes), `lora` (a peft actor's base model and
adapter), `plan` (the one `ExportPlan`), `lay_out` (the output dir before its weights)."""
