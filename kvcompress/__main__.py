from kvcompress.harness.cli import main

main()
