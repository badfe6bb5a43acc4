// Package testredis starts real redis-server processes for integration
// tests and benchmarks.
//
// Every server listens on a free loopback port (127.0.0.1 only, never the
// machine's 6379), runs in the foreground as a child of the test process
// (never daemonized), keeps no data on disk (no RDB snapshots, no AOF) and
// lives in its own temporary directory, which holds its log file. Tests get
// a server with New or NewN, which stop it when the test ends; a program
// that has no testing.T (such as the benchmark command) uses Start and
// StopAll.
//
// Because the process is owned by the Go side, tests can simulate failures:
// Kill crashes the server (SIGKILL), Restart brings it back empty on the same
// port, Pause and Resume freeze and thaw it (SIGSTOP/SIGCONT).
//
// Do, Info, CommandStats and ResetStats talk to a server through a tiny
// built-in RESP2 client over a fresh connection per call. They exist for
// test assertions (for example, counting how many EVALSHA or PUBLISH calls a
// code path made) and deliberately share nothing with the client library
// under test.
//
// A test package that uses testredis should run its tests through Main, so
// that every server is stopped before goleak looks for leaked goroutines:
//
//	func TestMain(m *testing.M) { testredis.Main(m) }
//
// redis-server must be on PATH. When it is not, Start returns an error that
// says how to install it, and New fails the test: tests never skip because
// Redis is missing.
package testredis
