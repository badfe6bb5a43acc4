package testredis

import "syscall"

// childAttrs asks the kernel to SIGKILL redis-server if the process that started it
// dies (a test binary killed by go test's timeout), so no server outlives its test.
// The signal is tied to the OS thread that forked the child; Go keeps its threads
// for the life of the process, so in practice it fires when the test binary exits.
// ownSession also starts it in a session of its own (WithOwnSession).
func childAttrs(ownSession bool) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setsid: ownSession}
}
