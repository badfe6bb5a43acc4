//go:build unix

package lockapi_test

import (
	"syscall"
	"time"
)

// processCPU is the CPU time (user and system) this process has used so far;
// redis-server runs in a process of its own and is not counted.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
