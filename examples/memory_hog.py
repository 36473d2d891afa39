# Grows a list until the sandbox's memory ceiling stops it. Expect exit 137 and a note on stderr.
chunks = []
while True:
    chunks.append(bytearray(16 * 1024 * 1024))
    print(f"holding {len(chunks) * 16} MB", flush=True)
