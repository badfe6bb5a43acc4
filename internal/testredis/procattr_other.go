//go:build !linux

package testredis

import "syscall"

// childAttrs has nothing to add outside Linux.
func childAttrs() *syscall.SysProcAttr { return nil }
