"""KIVI quantized storage (``kivi``) and its packed-integer group quantizer (``quantizer``)."""
