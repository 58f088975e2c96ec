// A conformance client of the fctkit protocol in Node (@grpc/grpc-js + @grpc/proto-loader),
// written from docs/reference/protocol.md and the .proto files. It exercises a real `fctkit serve` and
// prints one JSON line per check: {"check": name, "ok": true|false, "detail": ...}; it exits 1
// when any check fails.
//
// Environment: FCTKIT_TARGET (host:port), FCTKIT_PROTO_DIR (the folder holding fctkit/v1/*.proto),
// FCTKIT_CODE_A and FCTKIT_CODE_B (enrolment codes of two different owners), FCTKIT_ADMIN_TOKEN,
// FCTKIT_PUBLISH_ARCHIVE (a bundle archive of the next version, published while a Watch is open).
'use strict';

const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const loader = require('@grpc/proto-loader');

const env = (name) => {
  if (!process.env[name]) throw new Error(`${name} is not set`);
  return process.env[name];
};
const target = env('FCTKIT_TARGET');
const protoDir = env('FCTKIT_PROTO_DIR');
const definition = loader.loadSync(
  ['fctkit/v1/registry.proto', 'fctkit/v1/vault.proto', 'fctkit/v1/fleet.proto'].map((f) => path.join(protoDir, f)),
  { includeDirs: [protoDir], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true },
);
const v1 = grpc.loadPackageDefinition(definition).fctkit.v1;
const credentials = grpc.credentials.createInsecure();
const registry = new v1.Registry(target, credentials);
const vault = new v1.Vault(target, credentials);
const fleet = new v1.Fleet(target, credentials);

const bearer = (token) => {
  const metadata = new grpc.Metadata();
  metadata.set('authorization', `Bearer ${token}`);
  return metadata;
};
const unary = (client, method, request, metadata = new grpc.Metadata()) =>
  new Promise((resolve, reject) => client[method](request, metadata, (error, response) => (error ? reject(error) : resolve(response))));
const codeName = (code) => Object.keys(grpc.status).find((name) => grpc.status[name] === code);
const sha256 = (bytes) => crypto.createHash('sha256').update(bytes).digest('hex');

// A server stream read to its end; `stopAfter(message)` true cancels the call after that message.
function readStream(call, stopAfter = () => false) {
  return new Promise((resolve, reject) => {
    const messages = [];
    call.on('data', (message) => {
      messages.push(message);
      if (stopAfter(message)) {
        call.cancel();
        resolve(messages);
      }
    });
    call.on('error', (error) => (error.code === grpc.status.CANCELLED ? resolve(messages) : reject(error)));
    call.on('end', () => resolve(messages));
  });
}

// Header first, then contiguous chunks carrying the bytes from the header's offset.
function chunksOf(messages, kind) {
  const [first, ...rest] = messages;
  if (!first || first.payload !== 'header') throw new Error(`the ${kind} stream did not start with its header`);
  let position = Number(first.header.offset || 0);
  const parts = rest.map((m) => {
    if (m.payload !== 'chunk' || Number(m.chunk.offset) !== position) throw new Error(`${kind}: chunk not contiguous at ${position}`);
    position += m.chunk.data.length;
    return m.chunk.data;
  });
  return { header: first.header, data: Buffer.concat(parts) };
}

function clientStream(client, method, metadata, messages) {
  return new Promise((resolve, reject) => {
    const call = client[method](metadata, (error, response) => (error ? reject(error) : resolve(response)));
    for (const message of messages) call.write(message);
    call.end();
  });
}

const results = [];
async function check(name, body) {
  try {
    const detail = await body();
    results.push({ check: name, ok: true, detail: detail ?? null });
  } catch (error) {
    results.push({ check: name, ok: false, detail: String(error && (error.stack || error.message) || error) });
  }
  console.log(JSON.stringify(results[results.length - 1]));
}
const expectCode = async (promise, wanted) => {
  try {
    await promise;
  } catch (error) {
    if (codeName(error.code) === wanted) return wanted;
    throw new Error(`expected ${wanted}, got ${codeName(error.code)}: ${error.details}`);
  }
  throw new Error(`expected ${wanted}, the call succeeded`);
};
const assert = (condition, message) => {
  if (!condition) throw new Error(message);
};

async function main() {
  let deviceA; let deviceB; let latest; let manifest;
  await check('enrol', async () => {
    deviceA = await unary(fleet, 'Enrol', { code: env('FCTKIT_CODE_A'), device_name: 'node-a' });
    deviceB = await unary(fleet, 'Enrol', { code: env('FCTKIT_CODE_B'), device_name: 'node-b' });
    assert(deviceA.token && deviceA.device_id && deviceA.owner_id, 'enrolment lacks token, device id or owner id');
    assert(deviceA.publisher_public_key.length === 32, 'the publisher key is not 32 raw bytes');
    assert(sha256(deviceA.publisher_public_key) === deviceA.publisher_key_id, 'publisher_key_id is not SHA-256 of the key');
    assert(deviceA.owner_id !== deviceB.owner_id, 'two codes of different owners gave one owner');
    return { device_id: deviceA.device_id };
  });
  const a = bearer(deviceA.token);
  const b = bearer(deviceB.token);

  await check('list versions', async () => {
    const listed = await unary(registry, 'ListVersions', { after_version: 0 }, a);
    assert(listed.versions.length >= 1, 'no published version');
    latest = listed.versions[listed.versions.length - 1];
    assert(listed.latest_version === latest.version, 'latest_version disagrees with the list');
    return { versions: listed.versions.map((v) => v.version) };
  });

  await check('manifest signature', async () => {
    const got = await unary(registry, 'GetManifest', { version: latest.version }, a);
    const spki = Buffer.concat([Buffer.from('302a300506032b6570032100', 'hex'), deviceA.publisher_public_key]);
    const key = crypto.createPublicKey({ key: spki, format: 'der', type: 'spki' });
    assert(crypto.verify(null, got.manifest, key, got.signature), 'the Ed25519 signature does not verify');
    const tampered = Buffer.from(got.manifest);
    tampered[tampered.length - 2] ^= 1;
    assert(!crypto.verify(null, tampered, key, got.signature), 'a tampered manifest verified');
    manifest = JSON.parse(got.manifest.toString('ascii'));
    assert(manifest.version === latest.version && manifest.publisher_key_id === deviceA.publisher_key_id, 'manifest header mismatch');
    assert(sha256(got.manifest) === latest.manifest_sha256, 'manifest_sha256 mismatch');
    return { artifacts: manifest.artifacts.map((x) => x.name) };
  });

  await check('artifact download with resume', async () => {
    const artifact = manifest.artifacts.reduce((big, x) => (x.size > big.size ? x : big));
    const chunk = 4096;
    const first = chunksOf(await readStream(
      registry.DownloadArtifact({ version: latest.version, artifact_name: artifact.name, chunk_size: chunk }, a),
      (m) => m.payload === 'chunk'), 'artifact');
    assert(first.data.length > 0 && first.data.length < artifact.size, 'the first part is not a part');
    const rest = chunksOf(await readStream(registry.DownloadArtifact(
      { version: latest.version, artifact_name: artifact.name, offset: first.data.length, chunk_size: 65536 }, a)), 'artifact');
    assert(Number(rest.header.offset) === first.data.length, 'the resumed header does not echo the offset');
    const whole = Buffer.concat([first.data, rest.data]);
    assert(whole.length === artifact.size && sha256(whole) === artifact.sha256, 'the resumed artifact does not match the manifest');
    await expectCode(readStream(registry.DownloadArtifact(
      { version: latest.version, artifact_name: artifact.name, offset: artifact.size + 1 }, a)), 'OUT_OF_RANGE');
    return { artifact: artifact.name, bytes: whole.length, resumed_at: first.data.length };
  });

  const blob = crypto.randomBytes(300000);
  const blobSha = sha256(blob);
  await check('vault upload, list, download, delete', async () => {
    const cut = 100000;
    await expectCode(clientStream(vault, 'Upload', a, [
      { header: { sha256: blobSha, size: blob.length, item_id: 'node-item', offset: 0 } },
      { chunk: { offset: 0, data: blob.subarray(0, cut) } }]), 'INVALID_ARGUMENT');  // the stream ended early
    const stat = await unary(vault, 'Stat', { sha256: blobSha }, a);
    assert(stat.state === 'BLOB_STATE_PARTIAL' && Number(stat.received) === cut, `Stat says ${stat.state} ${stat.received}`);
    const messages = [{ header: { sha256: blobSha, size: blob.length, item_id: 'node-item', offset: cut } }];
    for (let at = cut; at < blob.length; at += 65536) messages.push({ chunk: { offset: at, data: blob.subarray(at, at + 65536) } });
    const stored = await clientStream(vault, 'Upload', a, messages);
    assert(stored.blob.sha256 === blobSha && Number(stored.blob.size) === blob.length, 'upload response mismatch');
    const listed = await unary(vault, 'List', {}, a);
    assert(listed.blobs.some((x) => x.sha256 === blobSha), 'List does not show the blob');
    const down = chunksOf(await readStream(vault.Download({ sha256: blobSha, chunk_size: 65536 }, a)), 'blob');
    assert(down.data.equals(blob), 'the downloaded blob differs');
    await unary(vault, 'Delete', { sha256: blobSha }, a);
    await expectCode(readStream(vault.Download({ sha256: blobSha }, a)), 'NOT_FOUND');
    return { bytes: blob.length, resumed_at: cut };
  });

  await check('watch sees a publish', async () => {
    const archive = fs.readFileSync(env('FCTKIT_PUBLISH_ARCHIVE'));
    const seen = readStream(registry.WatchVersions({ after_version: latest.version }, a),
      (m) => m.event === 'published');
    await new Promise((resolve) => setTimeout(resolve, 300));
    const messages = [{ header: { archive_size: archive.length, archive_sha256: sha256(archive) } }];
    for (let at = 0; at < archive.length; at += 1 << 20) messages.push({ chunk: { offset: at, data: archive.subarray(at, at + (1 << 20)) } });
    const published = await clientStream(registry, 'PublishBundle', bearer(env('FCTKIT_ADMIN_TOKEN')), messages);
    const events = await Promise.race([seen, new Promise((_, reject) => setTimeout(() => reject(new Error('no event in 10 s')), 10000))]);
    const event = events.find((m) => m.event === 'published');
    assert(event && event.published.version === published.version.version, 'the Watch did not report the published version');
    return { published: published.version.version };
  });

  await check('status codes', async () => {
    const codes = {};
    codes.bad_token = await expectCode(unary(registry, 'ListVersions', {}, bearer('not-a-token')), 'UNAUTHENTICATED');
    codes.no_token = await expectCode(unary(registry, 'ListVersions', {}), 'UNAUTHENTICATED');
    codes.device_as_admin = await expectCode(unary(fleet, 'ListDevices', {}, a), 'PERMISSION_DENIED');
    const other = crypto.randomBytes(1000);
    await clientStream(vault, 'Upload', b, [{ header: { sha256: sha256(other), size: other.length, item_id: 'b', offset: 0 } },
      { chunk: { offset: 0, data: other } }]);
    codes.other_owners_blob = await expectCode(readStream(vault.Download({ sha256: sha256(other) }, a)), 'PERMISSION_DENIED');
    codes.malformed_sha256 = await expectCode(readStream(vault.Download({ sha256: 'xyz' }, a)), 'INVALID_ARGUMENT');
    const garbage = new grpc.Client(target, credentials).makeUnaryRequest(
      '/fctkit.v1.Registry/ListVersions', (x) => x, (x) => x, Buffer.from([0xff, 0xff, 0xff]), a, () => {});
    codes.undecodable_request = await expectCode(new Promise((resolve, reject) => garbage.on('status', (s) =>
      (s.code === grpc.status.OK ? resolve() : reject(Object.assign(new Error(s.details), { code: s.code, details: s.details }))))),
    'INVALID_ARGUMENT');
    return codes;
  });

  for (const client of [registry, vault, fleet]) client.close();
  process.exitCode = results.every((r) => r.ok) ? 0 : 1;
}

main().catch((error) => {
  console.log(JSON.stringify({ check: 'client', ok: false, detail: String(error.stack || error) }));
  process.exitCode = 1;
});
